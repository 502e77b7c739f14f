"""`WorkerMonitor`: the thread that watches one node's worker processes once they run, and reports the cause.

It wakes when a worker exits (its sentinel) or reports a fatal failure on its
status pipe, and tells the executor of the first death (`on_death`) or
collective step's exception (`on_fatal`); it removes what a dead worker left
in /dev/shm. A collective's error that reads like a lost peer ("Connection
closed by peer") is the consequence of another rank's death or exception,
which shows up at about the same moment: such a report is held for up to
CONSEQUENCE_HOLD_S while the monitor looks for its cause (a death, or a rank's
own exception), and reported only if none comes (its peer was on another
node: the heartbeats judge that). Policy (what a failure means for calls in
flight) is the executor's.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from rayfree.cluster.peers import peer_gone
from rayfree.supervisor import Supervised, supervisor
from rayfree.worker.messages import Fatal, decode

__all__ = ["WorkerMonitor", "CONSEQUENCE_HOLD_S"]

logger = logging.getLogger("rayfree.executor")

#: how long a collective's "lost peer" error waits for the death or exception that caused it
CONSEQUENCE_HOLD_S = 0.2

Handle = Any  # a workers.WorkerHandle (workers.py imports this module)


class WorkerMonitor:
    """Watches `workers` from `start()` until `stop()` (see the module docstring)."""

    def __init__(
        self,
        workers: list[Handle],
        on_death: Callable[[Handle], None],
        on_fatal: Callable[[Handle, Fatal], None],
        remove_leftovers: Callable[[Handle], None],
    ) -> None:
        self.workers = workers
        self.on_death = on_death
        self.on_fatal = on_fatal
        self.remove_leftovers = remove_leftovers
        self.stopped = False
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._thread: Supervised | None = None

    def start(self) -> None:
        self._thread = supervisor().start("RayfreeWorkerMonitor", self._run, stop=self.stop)

    def stop(self) -> None:
        """From now on nothing is reported (our own stop is no failure); the thread wakes and ends."""
        if not self.stopped:
            self.stopped = True
            self._wake_w.close()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def release(self) -> None:
        self._wake_r.close()

    def _run(self) -> None:
        sentinels = {w.proc.sentinel: w for w in self.workers}
        status = {w.ready_pipe: w for w in self.workers if w.ready_pipe is not None}
        held: tuple[Handle, Fatal, float] | None = None  # a consequence, waiting for its cause
        reported: set[int] = set()  # ranks that sent a Fatal: their exit that follows is no new cause
        while not self.stopped:
            timeout = None if held is None else max(0.0, held[2] - time.monotonic())
            ready = multiprocessing.connection.wait([*sentinels, *status, self._wake_r], timeout=timeout)
            if self.stopped or self._wake_r in ready:
                return
            causes: list[tuple[Handle, Fatal | None]] = []
            for s in [s for s in ready if s in sentinels]:  # exits first: a death is the cause of what follows
                w = sentinels.pop(s)
                w.proc.join(0.5)
                last = None
                for pipe in [p for p, x in status.items() if x is w]:
                    last = _last_fatal(pipe)  # a Fatal sent just before it left
                    del status[pipe]
                self.remove_leftovers(w)
                if last is not None or w.rank not in reported:
                    causes.append((w, last))
            for pipe in [p for p in ready if p in status]:
                w = status[pipe]
                try:
                    msg = decode(pipe.recv_bytes())
                except (EOFError, OSError):
                    del status[pipe]
                    continue  # it is leaving: its sentinel tells how
                except Exception as e:  # noqa: BLE001 - a garbled report is still a report
                    logger.error("%s sent an unreadable status message: %s", w.describe(), e)
                    continue
                if isinstance(msg, Fatal):
                    causes.append((w, msg))
            for w, msg in causes:
                if msg is not None:
                    reported.add(w.rank)
                if msg is not None and peer_gone(msg.error_type, msg.message, timeouts=False):
                    if held is None:
                        held = (w, msg, time.monotonic() + CONSEQUENCE_HOLD_S)
                    continue
                held = None  # its cause is here
                if self.stopped:
                    return
                if msg is not None:
                    self.on_fatal(w, msg)
                else:
                    self.on_death(w)
            if held is not None and time.monotonic() >= held[2] and not self.stopped:
                w, msg, _ = held
                held = None
                self.on_fatal(w, msg)


def _last_fatal(pipe: Connection) -> Fatal | None:
    try:
        if pipe.poll(0):
            msg = decode(pipe.recv_bytes())
            return msg if isinstance(msg, Fatal) else None
    except (EOFError, OSError):
        pass
    except Exception:  # noqa: BLE001 - unreadable: the exit itself is what is left to report
        pass
    return None
