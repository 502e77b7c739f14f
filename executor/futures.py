"""Futures that fill themselves in call order: a non-blocking call's `FutureWrapper`, read by whoever waits first.

Replies come back through per-rank FIFO queues, so the reply to call 2 can
only be read after the reply to call 1: `result()` drives the oldest pending
call first, under the pipe's lock. Unlike vLLM's futures, `result(timeout=)`
works: a wait that runs out leaves the call pending (`WaitExpired` inside),
and a later `result()` continues where it stopped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from typing import Any

__all__ = ["FutureWrapper", "WaitExpired"]


class WaitExpired(Exception):
    """The caller's own wait ran out (not the RPC's deadline): try again later."""


class FutureWrapper(Future[Any]):
    """A Future filled by `collect(deadline)`, in the order the calls were made."""

    def __init__(
        self,
        queue: deque[FutureWrapper],
        lock: threading.RLock,
        collect: Callable[[float | None], Any],
        aggregate: Callable[[Any], Any] = lambda x: x,
    ) -> None:
        super().__init__()
        self._queue = queue
        self._lock = lock
        self._collect = collect
        self._aggregate = aggregate
        queue.appendleft(self)

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.done():
            if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise FutureTimeout()
            try:
                while not self.done():
                    oldest = self._queue[-1]
                    oldest._drive(deadline)
                    self._queue.pop()
            except WaitExpired:
                raise FutureTimeout() from None
            finally:
                self._lock.release()
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except FutureTimeout:
            raise
        except BaseException:  # noqa: BLE001 - reported below
            pass
        return super().exception(timeout=0)

    def drive_now(self, deadline: float | None) -> None:
        """`_drive`, for the executor's own thread while it holds the lock (reading replies while a send waits)."""
        self._drive(deadline)

    def _drive(self, deadline: float | None) -> None:
        """Read this call's replies; WaitExpired leaves it pending, anything else completes it."""
        try:
            value = self._aggregate(self._collect(deadline))
        except WaitExpired:
            raise
        except Exception as e:  # noqa: BLE001 - the call's outcome
            with suppress(InvalidStateError):
                self.set_exception(e)
            return
        with suppress(InvalidStateError):
            self.set_result(value)
