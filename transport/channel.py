"""The one small interface every path of a queue implements: a `Sender` on the writer, a `Receiver` per reader.

Two backends: shared memory (shm_channel.py: the ring, plus its ipc overflow
socket) and sockets (zmq_channel.py: ZeroMQ pub/sub over TCP for remote
readers, or ipc). The queue (writer.py, reader.py) only talks to these.
Like dask's `Comm`, closing is two verbs: `close` tells the other side that
nothing more comes and lets what is in flight arrive; `abort` drops everything
at once (the process is failing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

__all__ = ["Sender", "Receiver"]


class Sender(ABC):
    """The writer's end of one path to some readers."""

    #: "shm", "ipc" or "tcp": how the bytes travel (for logs, errors and the topology)
    path: str
    #: the ranks this path reaches
    readers: list[int]

    @abstractmethod
    def send(self, frames: list, sizes: list[int], deadline: float | None,
             on_wait: Callable[[], None] | None = None) -> None:
        """One message (frame 0 the pickle stream, then its out-of-band buffers) to every reader of this path.

        Waits while readers lag, until `deadline` (QueueTimeout naming them), calling `on_wait` every few
        milliseconds meanwhile; QueueShutdown after `shutdown()`. Nothing is sent when it raises.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Make a blocked and every later `send` raise QueueShutdown (any thread)."""

    @abstractmethod
    def close(self) -> None:
        """Readers learn that no more messages come; what was sent still arrives."""

    @abstractmethod
    def abort(self) -> None:
        """Release everything now; what is in flight may be lost."""


class Receiver(ABC):
    """One reader's end of a path."""

    path: str

    @abstractmethod
    def recv(self, timeout: float | None, indefinite: bool) -> Any:
        """The next message as an object. QueueTimeout after `timeout` seconds (None: wait, logging now and
        then unless `indefinite`); QueueClosed once the writer closed; QueueShutdown after `shutdown()`."""

    @abstractmethod
    def shutdown(self) -> None:
        """Make a blocked and every later `recv` raise QueueShutdown (any thread)."""

    @abstractmethod
    def close(self) -> None:
        """Release the receiver's resources (after `shutdown()` if another thread may be blocked in it)."""
