"""The restart contract on a node that runs the engine's entry point: out, non-zero, soon after any failure.

A launcher restarts a node only when its process exits (LeaderWorkerSet's
RecreateGroupOnPodRestart, Slurm's --kill-on-bad-exit, compose's `restart:`).
An entry that is idle when the cluster fails (waiting for requests, not
calling the executor) would otherwise keep the node alive until it returns.
So, once the cluster has failed (or the operator stopped the node), the node's
policy (executor/failure_policy.py) does, on its thread:

1. the entry is told first: its pending calls raise the failure and its
   failure callback has run, and the node's workers are stopped (what an entry
   that reacts waits for: its `ex.shutdown()` or `ex.wait_done()` returns then);
2. then it has `RAYFREE_ENTRY_GRACE_S` (0.5 s) to return;
3. then the policy interrupts it: a SIGUSR2 sent to the main thread, whose
   handler (installed here) raises `EntryInterrupted` there, so a
   `time.sleep` or a blocking read ends too; the node shuts down and exits;
4. an entry that swallows the interrupt or sits in native code does not hold
   the node either: `HARD_EXIT_S` later the process leaves (the workers are
   stopped by then).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from rayfree import settings

__all__ = ["EntryWatch", "EntryInterrupted", "HARD_EXIT_S", "INTERRUPT_SIGNAL"]

#: after the interrupt, how long the entry and the shutdown have before the process leaves regardless
HARD_EXIT_S = 1.0
#: the signal the policy sends to the main thread (a real signal: it interrupts a sleep or a blocking read)
INTERRUPT_SIGNAL = signal.SIGUSR2


class EntryInterrupted(BaseException):
    """The cluster failed (or the node was stopped) and the entry point did not return within
    RAYFREE_ENTRY_GRACE_S (a BaseException, so no `except Exception` in the engine swallows it)."""


class EntryWatch:
    """`with EntryWatch(liveness, node, exit_code):` around the entry point, on the main thread."""

    def __init__(self, liveness: Any, node: int, exit_code: int = 1) -> None:
        self.liveness = liveness
        self.node = node
        self.grace_s = float(settings.get("RAYFREE_ENTRY_GRACE_S"))
        self._entry = liveness.policy.watch_entry(self.grace_s, HARD_EXIT_S, exit_code)
        self._old: Any = None

    def __enter__(self) -> EntryWatch:
        self._old = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._entry.done.set()
        signal.signal(INTERRUPT_SIGNAL, self._old)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._entry.interrupted and not self._entry.done.is_set():
            why = "the cluster failed" if self.liveness.failure is not None else "the node was stopped"
            raise EntryInterrupted(
                f"node {self.node}: {why} and the entry point did not return within {self.grace_s:g}s "
                f"(RAYFREE_ENTRY_GRACE_S): stopped it"
            )
