"""Did a failure come from a peer that went away? Typed errors first; gloo's words only where it gives no type.

A rank on another node (or another process of this node) that dies shows up
first as a collective's error on its peers. Python and torch give types for
most of it (ConnectionError and its kin, torch's DistNetworkError,
TimeoutError); gloo raises a plain RuntimeError, so its messages are matched
here, in this one function, and every phrase has its own test
(tests/executor/test_peers.py). The worker uses it to log such an error as
the consequence it is; the executor, to look for the death that caused it.
"""

from __future__ import annotations

__all__ = [
    "peer_gone",
    "GONE_TYPES",
    "TIMEOUT_TYPES",
    "GLOO_GONE_PHRASES",
    "GLOO_TIMEOUT_PHRASES",
    "RENDEZVOUS_GONE",
]

#: exception classes (as a worker reports them, by name) raised when the other end of a link went away
GONE_TYPES = frozenset(
    {
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "DistNetworkError",
        "QueueBroken",
        "GroupLeft",
    }
)
#: ... and when a wait for a peer ran out
TIMEOUT_TYPES = frozenset({"TimeoutError", "DistStoreError", "QueueTimeout", "RpcTimeout"})
#: gloo's RuntimeError texts for a peer that went away ("Connection closed by peer [10.0.0.2]:1234", "Read error
#: [...]: Connection reset by peer", "Write error [...]: Broken pipe", "Connection refused")
GLOO_GONE_PHRASES = ("connection", "peer", "broken pipe")
#: rayfree's own rendezvous (join.py) whose host, rank 0, went away while a rank waited in it
RENDEZVOUS_GONE = "rendezvous closed under this rank"
#: ... and for a peer that never answered ("Timed out waiting 30000ms for recv operation to complete", "Connect
#: timeout [...]")
GLOO_TIMEOUT_PHRASES = ("timed out", "timeout")


def peer_gone(error_type: str, message: str, timeouts: bool = True) -> bool:
    """Does an error of class `error_type` with `message` read like its peer went away (with `timeouts`, also
    like a wait for it that ran out)?"""
    if error_type in GONE_TYPES:
        return True
    if error_type in TIMEOUT_TYPES:
        return timeouts
    m = message.lower()
    gone = (*GLOO_GONE_PHRASES, RENDEZVOUS_GONE)
    return any(p in m for p in gone) or (timeouts and any(p in m for p in GLOO_TIMEOUT_PHRASES))
