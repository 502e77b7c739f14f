"""The one small face every path of a queue has: a `Sender` on the writer, a `Receiver` per reader.

Two backends: shared memory (`shm/sender.py`, `shm/receiver.py`: the ring, plus its overflow
socket) and sockets (`zmq/sender.py`, `zmq/receiver.py`: ZeroMQ pub/sub over TCP for remote
readers, or ipc). The queue (`queue/writer.py`, `queue/reader.py`) holds a
list of these and nothing below them.

Each face has a non-blocking hot path (`try_send`, `try_recv`) and a blocking
one with a deadline (`send`, `recv`). Every blocking path waits in one loop,
`Endpoint.wait`: it owns the shutdown flag, the deadline, the periodic log
line and the count of threads inside (so `close` can let them out first); a
backend only supplies one `attempt` that may block for a slice. Like dask's
`Comm`, closing is two verbs: `close` tells the other side that nothing more
comes and lets what is in flight arrive; `abort` drops everything at once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from rayfree import settings

from .errors import QueueShutdown, QueueTimeout

__all__ = ["Endpoint", "Sender", "Receiver", "Waiters", "EMPTY", "frame_sizes"]

logger = logging.getLogger("rayfree.transport")

T = TypeVar("T")

#: `try_recv`: nothing is ready now.
EMPTY: Any = object()

_perf = time.perf_counter


def frame_sizes(frames: list[Any]) -> list[int]:
    """The byte length of each frame (bytes, or a buffer such as a pickle's out-of-band view)."""
    return [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]


class Waiters:
    """Counts threads blocked inside a channel, so `close()` can let them leave before it unmaps.

    Only the blocking paths enter it (one thread per channel end blocks at a time, so a plain counter is
    enough); `close()` is rare and polls.
    """

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __enter__(self) -> None:
        self.n += 1

    def __exit__(self, *exc: object) -> None:
        self.n -= 1

    def wait_idle(self, timeout: float) -> bool:
        """True once no thread is inside (False if some still are after `timeout`)."""
        end = time.monotonic() + timeout
        while self.n > 0:
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)
        return True


class Endpoint:
    """What both faces share: the shutdown flag, the waiters, and the one wait loop."""

    #: "shm", "ipc" or "tcp": how the bytes travel (for logs, errors and the topology)
    path: str = ""

    def __init__(self) -> None:
        self.shutdown_requested = False
        self.waiters = Waiters()
        self.log_interval: float = settings.get("RAYFREE_WAIT_LOG_INTERVAL_S")

    def wait(
        self,
        attempt: Callable[[float], T | None],
        deadline: float | None,
        what: str,
        late: Callable[[float], str],
        *,
        slice_s: float = 0.1,
        on_wait: Callable[[], None] | None = None,
        log: Callable[[float], str] | None = None,
        log_level: int = logging.INFO,
        log_every: float | None = None,
        t0: float | None = None,
    ) -> T:
        """Call `attempt(seconds)` (it may block up to that long) until it returns something not None.

        Before each attempt: QueueShutdown once `shutdown()` was called. After a fruitless one:
        QueueTimeout past `deadline` (its text: `what` timed out after N s, then `late(waited)`), the
        line `log(waited)` every `log_every` seconds (default RAYFREE_WAIT_LOG_INTERVAL_S; at `log_level`; None:
        no line), and `on_wait()` (then
        the slices are 5 ms, so the caller's work keeps going). The attempt at the deadline is a
        zero-second look, so what has already arrived is taken.
        """
        if t0 is None:
            t0 = _perf()
        every = self.log_interval if log_every is None else log_every
        next_log = t0 + every
        if on_wait is not None:
            slice_s = min(slice_s, 0.005)
        with self.waiters:
            while True:
                if self.shutdown_requested:
                    raise QueueShutdown(f"{what} interrupted: shutdown() was called on this queue")
                now = _perf()
                left = min(slice_s, next_log - now)
                if deadline is not None:
                    left = min(left, deadline - now)
                got = attempt(max(0.0, left))
                if got is not None:
                    return got
                now = _perf()
                if deadline is not None and now >= deadline:
                    raise QueueTimeout(f"{what} timed out after {now - t0:.3f}s{late(now - t0)}")
                if now >= next_log:
                    if log is not None:
                        logger.log(log_level, "%s", log(now - t0))
                    next_log = now + every
                if on_wait is not None:
                    on_wait()

    def shutdown(self) -> None:
        """Make a blocked and every later blocking call raise QueueShutdown (any thread)."""
        self.shutdown_requested = True


class Sender(Endpoint, ABC):
    """The writer's end of one path to some readers."""

    #: the ranks this path reaches
    readers: list[int]

    @abstractmethod
    def try_send(self, frames: list[Any], sizes: list[int] | None = None) -> bool:
        """One message (frame 0 the pickle stream, then its out-of-band buffers) to every reader of this
        path if that can be done now; False (nothing sent) if a reader lags. The hot path."""

    @abstractmethod
    def send(
        self,
        frames: list[Any],
        sizes: list[int] | None,
        deadline: float | None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """`try_send`, waiting while readers lag, until `deadline` (QueueTimeout naming them), calling
        `on_wait` every few milliseconds meanwhile; QueueShutdown after `shutdown()`. Nothing is sent when it
        raises."""

    @abstractmethod
    def close(self) -> None:
        """Readers learn that no more messages come; what was sent still arrives."""

    @abstractmethod
    def abort(self) -> None:
        """Release everything now; what is in flight may be lost."""

    def status(self) -> dict[str, Any]:
        """What a look from another thread may see of this path (racy by design)."""
        return {}


class Receiver(Endpoint, ABC):
    """One reader's end of a path."""

    @abstractmethod
    def try_recv(self) -> Any:
        """The next message as an object if one is ready now, else EMPTY. The hot path."""

    def recv(self, timeout: float | None, indefinite: bool = False) -> Any:
        """The next message. QueueTimeout after `timeout` seconds (None: wait, logging now and then unless
        `indefinite`); QueueClosed once the writer closed; QueueShutdown after `shutdown()`."""
        obj = self.try_recv()
        if obj is not EMPTY:
            return obj
        return self.recv_waiting(None if timeout is None else _perf() + max(0.0, timeout), indefinite)

    @abstractmethod
    def recv_waiting(self, deadline: float | None, indefinite: bool) -> Any:
        """`recv` once `try_recv` found nothing."""

    @abstractmethod
    def close(self) -> None:
        """Release the receiver's resources (after `shutdown()` if another thread may be blocked in it)."""
