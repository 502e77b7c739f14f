"""`Waker`: a pipe another thread writes to end a poll at once, so a waiting thread needs no slices to see a stop.

A thread that waits in a ZeroMQ poll for messages would otherwise wake every
slice to look whether someone asked it to stop, which is what an idle cluster
spends its CPU on. The poll watches the pipe's read end beside its sockets;
`wake` (any thread) writes a byte, `drain` (the owner) reads them back.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["Waker"]


class Waker:
    """One pipe: `fd` for the owner's poll, `wake` from any thread, `drain` by the owner, `close` once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        """End the owner's current poll (a no-op once closed, or while a wake is pending already)."""
        with self._lock:
            if self._w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._w, b"w")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.fd, 256):
                pass

    def close(self) -> None:
        with self._lock:
            for fd in (self.fd, self._w):
                if fd >= 0:
                    os.close(fd)
            self.fd = self._w = -1
