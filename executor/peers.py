"""Did a failure come from a peer that went away? Typed errors first; gloo's words only where it gives no type.

A rank on another node that dies shows up first as a collective's error on
its peers (or as a rendezvous that broke at start-up); the cluster's
heartbeats name that node within their suspect window, and that is the
cause to report. Python and torch give types for most of it (ConnectionError
and its kin, torch's DistNetworkError, TimeoutError); gloo raises a plain
RuntimeError, so its messages are matched here, in this one function, and
every phrase has its own test (tests/executor/test_peers.py).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["peer_gone", "await_verdict", "GLOO_GONE_PHRASES", "GLOO_TIMEOUT_PHRASES"]

logger = logging.getLogger("rayfree.executor")

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
    }
)
#: ... and when a wait for a peer ran out
TIMEOUT_TYPES = frozenset({"TimeoutError", "DistStoreError", "QueueTimeout", "RpcTimeout"})
#: gloo's RuntimeError texts for a peer that went away ("Connection closed by peer [10.0.0.2]:1234", "Read error
#: [...]: Connection reset by peer", "Write error [...]: Broken pipe", "Connection refused")
GLOO_GONE_PHRASES = ("connection", "peer", "broken pipe")
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
    return any(p in m for p in GLOO_GONE_PHRASES) or (timeouts and any(p in m for p in GLOO_TIMEOUT_PHRASES))


def await_verdict(liveness: Any, error_type: str, message: str, timeouts: bool = True, what: str = "") -> bool:
    """If an error reads like a lost peer and this node's heartbeats can judge (a NodeLiveness of a cluster of
    several nodes), wait for their verdict, bounded by their suspect window; True if it waited."""
    if liveness is None or not liveness.verdict_s() or not peer_gone(error_type, message, timeouts):
        return False
    if liveness.beater is not None and peer_gone(error_type, message, timeouts=False):
        liveness.beater.corroborate()  # a dropped heartbeat connection and a broken collective: a loss now
    if what and not liveness.settled.is_set():
        logger.info(
            "%s looks like a lost peer; waiting up to %.1fs for the heartbeats' verdict", what, liveness.verdict_s()
        )
    liveness.settled.wait(liveness.verdict_s())
    return True
