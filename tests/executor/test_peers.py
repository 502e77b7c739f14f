"""Each way a peer's departure shows up in an error, recognised (and what is not such an error, not)."""

from __future__ import annotations

import pytest

from rayfree.executor.peers import GLOO_GONE_PHRASES, GLOO_TIMEOUT_PHRASES, GONE_TYPES, TIMEOUT_TYPES, peer_gone

#: gloo's and torch's texts, as workers report them (RuntimeError), one per phrase
GLOO_GONE = {
    "connection": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242",
    "peer": "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [10.0.0.2]:4242: reset by peer",
    "broken pipe": "[../third_party/gloo/gloo/transport/tcp/pair.cc:610] Write error [10.0.0.2]:4242: Broken pipe",
}
GLOO_TIMEOUT = {
    "timed out": "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv",
    "timeout": "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Connect timeout [10.0.0.2]:4242",
}


def test_every_phrase_has_its_case() -> None:
    assert set(GLOO_GONE) == set(GLOO_GONE_PHRASES) and set(GLOO_TIMEOUT) == set(GLOO_TIMEOUT_PHRASES)


@pytest.mark.parametrize("phrase", sorted(GLOO_GONE))
def test_a_gloo_connection_error_is_a_peer_gone(phrase: str) -> None:
    assert peer_gone("RuntimeError", GLOO_GONE[phrase], timeouts=False)


@pytest.mark.parametrize("phrase", sorted(GLOO_TIMEOUT))
def test_a_gloo_timeout_counts_only_when_timeouts_do(phrase: str) -> None:
    assert peer_gone("RuntimeError", GLOO_TIMEOUT[phrase], timeouts=True)
    assert not peer_gone("RuntimeError", GLOO_TIMEOUT[phrase], timeouts=False)


@pytest.mark.parametrize("error_type", sorted(GONE_TYPES))
def test_a_typed_connection_error_is_a_peer_gone_whatever_its_text(error_type: str) -> None:
    assert peer_gone(error_type, "", timeouts=False)


@pytest.mark.parametrize("error_type", sorted(TIMEOUT_TYPES))
def test_a_typed_timeout_counts_only_when_timeouts_do(error_type: str) -> None:
    assert peer_gone(error_type, "", timeouts=True) and not peer_gone(error_type, "", timeouts=False)


@pytest.mark.parametrize(
    "error",
    [
        ("ValueError", "bad shape (2, 3)"),
        ("RuntimeError", "CUDA out of memory"),
        ("KeyError", "'weight'"),
        ("RuntimeError", "expected scalar type Float"),
    ],
)
def test_an_ordinary_error_is_not_a_peer_gone(error: tuple[str, str]) -> None:
    assert not peer_gone(*error)
