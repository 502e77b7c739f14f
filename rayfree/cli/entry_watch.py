"""The restart contract on a node that runs the engine's entry point: out, non-zero, soon after any failure.

A launcher restarts a node only when its process exits (LeaderWorkerSet's
RecreateGroupOnPodRestart, Slurm's --kill-on-bad-exit, compose's `restart:`).
An entry that is idle when the cluster fails (waiting for requests, not
calling the executor) would otherwise keep the node alive until it returns.
So, once the cluster has failed:

1. the entry is told first: its pending calls raise the failure and its
   failure callback has run (both before anything below), and the node's
   workers are stopped (what an entry that reacts waits for: its
   `ex.shutdown()` or `ex.wait_done()` returns then);
2. then it has `RAYFREE_ENTRY_GRACE_S` (0.5 s) to return;
3. then the node interrupts it (`EntryInterrupted`, raised in the main thread
   by a SIGUSR2 sent to that thread), and shuts down and exits 1;
4. an entry that swallows the interrupt or sits in native code does not hold
   the node either: `HARD_EXIT_S` later, once the workers are stopped, the
   process leaves with os._exit(1).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from rayfree import settings

__all__ = ["EntryWatch", "EntryInterrupted", "HARD_EXIT_S", "INTERRUPT_SIGNAL"]

logger = logging.getLogger("rayfree.node")

#: after the interrupt, how long the entry and the shutdown have before the process leaves regardless
HARD_EXIT_S = 1.0
#: how long the watch waits for the failure's shutdown of this node's executors before the grace starts
SHUTDOWN_WAIT_S = 3.0
#: the signal the watch sends to the main thread (a real signal: it interrupts a sleep or a blocking read)
INTERRUPT_SIGNAL = signal.SIGUSR2
_POLL_S = 1.0


class EntryInterrupted(BaseException):
    """The cluster failed and the entry point did not return within RAYFREE_ENTRY_GRACE_S (a BaseException, so
    no `except Exception` in the engine swallows it)."""


class EntryWatch:
    """While the entry runs (`with EntryWatch(...):`), watch the node's liveness for a failure (module docstring).

    `exit_code` is what the process leaves with if it must leave by force."""

    def __init__(self, liveness: Any, replicas: Any, node: int, exit_code: int = 1) -> None:
        self.liveness = liveness
        self.replicas = replicas
        self.node = node
        self.exit_code = exit_code
        self.grace_s = float(settings.get("RAYFREE_ENTRY_GRACE_S"))
        self._done = threading.Event()
        self._interrupted = False
        self._main = threading.main_thread().ident
        self._old: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="RayfreeEntryWatch")

    def __enter__(self) -> EntryWatch:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._old is not None:
            signal.signal(INTERRUPT_SIGNAL, self._old)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._interrupted and not self._done.is_set():
            raise EntryInterrupted(
                f"node {self.node}: the cluster failed and the entry point did not return within "
                f"{self.grace_s:g}s (RAYFREE_ENTRY_GRACE_S): stopped it"
            )

    def _failure(self) -> Exception | None:
        lv = self.liveness
        return lv.failure if lv.settled.is_set() else None

    def _run(self) -> None:
        while not self._done.is_set():
            if self.liveness.settled.wait(_POLL_S):
                break
        failure = self._failure()
        if self._done.is_set() or failure is None:
            return  # the entry returned first, or node 0 stopped the cluster cleanly
        first = str(failure).split("\n")[0]
        self.replicas.wait_done(SHUTDOWN_WAIT_S)  # the failure's staged close, bounded by its stages
        if self._done.is_set():
            return
        logger.error(
            "node %d: the cluster failed (%s); the entry point has %gs (RAYFREE_ENTRY_GRACE_S) to return, then "
            "this node stops it and exits",
            self.node,
            first,
            self.grace_s,
        )
        if self._done.wait(self.grace_s):
            return
        self._interrupted = True
        if self._main is not None:
            signal.pthread_kill(self._main, INTERRUPT_SIGNAL)
        if self._done.wait(HARD_EXIT_S):
            return
        logger.error(
            "node %d: the entry point ignored the interrupt for %gs; leaving without it (exit %d)",
            self.node,
            HARD_EXIT_S,
            self.exit_code,
        )
        try:
            self.replicas.wait_done(HARD_EXIT_S)  # the failure's shutdown already stops the workers
        finally:
            logging.shutdown()
            os._exit(self.exit_code)
