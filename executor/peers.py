"""Waiting for the heartbeats' verdict when an error reads like a lost peer (cluster/peers.py recognises it).

A rank on another node that dies shows up first as a collective's error on
its peers (or as a rendezvous that broke at start-up); the cluster's
heartbeats name that node within their suspect window, and that is the
cause to report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rayfree.cluster.peers import GLOO_GONE_PHRASES, GLOO_TIMEOUT_PHRASES, GONE_TYPES, TIMEOUT_TYPES, peer_gone

from .errors import failed_as
from .monitor import CONSEQUENCE_HOLD_S

__all__ = [
    "peer_gone",
    "await_verdict",
    "await_verdict_on_exit",
    "cause_of",
    "GONE_TYPES",
    "TIMEOUT_TYPES",
    "GLOO_GONE_PHRASES",
    "GLOO_TIMEOUT_PHRASES",
]

logger = logging.getLogger("rayfree.executor")


def await_verdict(
    liveness: Any, error_type: str, message: str, timeouts: bool = True, what: str = "", slack: float = 0.0
) -> bool:
    """If an error reads like a lost peer and this node's heartbeats can judge (a NodeLiveness of a cluster of
    several nodes), wait for their verdict, bounded by their suspect window (plus `slack`); True if it waited."""
    if liveness is None or not liveness.verdict_s() or not peer_gone(error_type, message, timeouts):
        return False
    if liveness.beater is not None and peer_gone(error_type, message, timeouts=False):
        liveness.beater.corroborate()  # a dropped heartbeat connection and a broken collective: a loss now
    if what and not liveness.settled.is_set():
        logger.info(
            "%s looks like a lost peer; waiting up to %.1fs for the heartbeats' verdict", what, liveness.verdict_s()
        )
    liveness.settled.wait(liveness.verdict_s() + slack)
    return True


def await_verdict_on_exit(liveness: Any, exitcode: int | None) -> bool:
    """A worker that left by itself (an exit code, not a signal) in a cluster of several nodes may have left
    because a peer node went away under its collective: wait, bounded, for the heartbeats' verdict, which is then
    the cause to report. True if it waited."""
    if liveness is None or not liveness.verdict_s() or exitcode is None or exitcode <= 0:
        return False
    liveness.settled.wait(liveness.verdict_s())
    return True


def cause_of(
    error: Any, name: str, liveness: Any, known: threading.Event | None, failure: Callable[[], Exception | None]
) -> Exception:
    """What a caller that got rank `error.rank`'s collective error (a FatalWorkerError) of RPC `name` raises.

    It waits (bounded) until the executor has recorded its failure and the failure callback has run (`known`),
    so the call raises after the callback. An error that reads like a lost peer is the consequence of another
    rank's death or exception, or of a lost node (the heartbeats' verdict is awaited for that): the recorded
    cause (`failure()`) is raised instead, with the call named."""
    gone = peer_gone(error.error_type, error.message)
    if gone:
        await_verdict(liveness, error.error_type, error.message, timeouts=False)
    if known is not None:
        verdict = liveness.verdict_s() if liveness is not None else 0.0
        known.wait(CONSEQUENCE_HOLD_S + verdict + 0.5)
    cause = failure()
    if (
        not gone
        or cause is None
        or cause is error
        or (getattr(cause, "rank", None) == error.rank and type(cause) is type(error))
    ):
        return error
    return failed_as(cause, f"RPC {name} failed: {cause}")
