"""`QueueWriter`: the writer's side of a MessageQueue — its paths, the handshake, enqueue, close.

Local readers are reached through the shared-memory ring (with its ipc
overflow socket), remote ones through a TCP publisher bound to `connect_ip`.
The writer holds them as a list of `Sender`s and nothing below that face:
every message is tried on each path's non-blocking `try_send` first, and
only a path that cannot take it now is waited on (`send`).
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any

from rayfree import settings

from .. import serde
from ..channel import Sender, Waiters, frame_sizes
from ..errors import MessageTooLarge
from ..net import get_ip, tcp_endpoint
from ..shm.sender import ShmSender
from ..zmq import lingering
from ..zmq.sender import READY, SocketSender
from .handle import Handle

__all__ = ["QueueWriter", "REMOTE_SNDHWM", "deadline_of"]

logger = logging.getLogger("rayfree.transport")

#: How many messages a remote subscriber may fall behind before enqueue waits.
REMOTE_SNDHWM = 1000

_perf = time.perf_counter


def deadline_of(timeout: float | None) -> float | None:
    """A perf_counter deadline; a negative timeout counts as 0 (as vLLM's queue does)."""
    if timeout is None:
        return None
    return _perf() + max(0.0, timeout)


def _cleanup(shm: ShmSender | None) -> None:
    # Runs at close() or, if the user never calls it, when the writer is collected
    # or the interpreter exits: never leave a segment or a directory behind.
    if shm is not None:
        shm.remove_names()


class QueueWriter:
    """See the module docstring; built by `MessageQueue(...)`."""

    def __init__(
        self,
        n_reader: int,
        local_reader_ranks: list[int],
        max_chunk_bytes: int,
        max_chunks: int,
        connect_ip: str | None,
        max_message_bytes: int | None,
        spin_us: float | None,
        subscribers: list[int] | None = None,
    ) -> None:
        local = set(local_reader_ranks)
        self.n_reader = n_reader
        self.local_reader_ranks = local_reader_ranks
        #: the readers that subscribe over TCP (all the remote ones, unless relays read for the rest)
        self.remote_reader_ranks = (
            [r for r in range(n_reader) if r not in local] if subscribers is None else list(subscribers)
        )
        self.max_message_bytes = max_message_bytes
        self.shm: ShmSender | None = None
        self.remote: SocketSender | None = None
        #: every path, in the order a message takes them
        self.senders: list[Sender] = []
        #: the object's frames (the writer's own pickler)
        self.dumps = serde.Serializer().dumps
        queue_id = secrets.token_bytes(16)
        try:
            if local_reader_ranks:
                self.shm = ShmSender.create(local_reader_ranks, max_chunk_bytes, max_chunks, queue_id, spin_us)
                self.senders.append(self.shm)
            if self.remote_reader_ranks:
                self.remote = SocketSender.publish(
                    tcp_endpoint(connect_ip or get_ip(), "*"), "tcp", self.remote_reader_ranks, REMOTE_SNDHWM, queue_id
                )
                self.senders.append(self.remote)
        except BaseException:
            self.abort()
            raise
        #: the one path of a queue that has one, when nothing (a size limit) must be checked first
        self.one_path = self.senders[0] if len(self.senders) == 1 and max_message_bytes is None else None
        self._finalizer = weakref.finalize(self, _cleanup, self.shm)
        self.handle = Handle.for_writer(
            queue_id,
            n_reader,
            local_reader_ranks,
            self.shm.names() if self.shm is not None else None,
            max_chunk_bytes,
            max_chunks,
            self.remote.endpoint if self.remote is not None else None,
            max_message_bytes,
        )

    # -- the handshake ----------------------------------------------------------------------

    def _announcers(self) -> list[SocketSender]:
        """The sockets the readers say hello on and READY comes from: the ring's overflow, and TCP."""
        return [s for s in (self.shm.overflow if self.shm is not None else None, self.remote) if s is not None]

    def handshake(self, deadline: float | None, timeout: float | None) -> None:
        """Wait until every reader is attached, remove the names from /dev/shm and the file system, send READY."""
        socks = self._announcers()
        missing = [set(s.readers) for s in socks]

        def attempt(wait_s: float) -> bool | None:
            for i, s in enumerate(socks):
                if missing[i]:
                    s.take_hellos(missing[i], wait_s)
                    wait_s = 0.0
            return None if any(missing) else True

        socks[0].wait(
            attempt,
            deadline,
            "wait_until_ready",
            lambda _: f": {self._describe(socks, missing)}",
            slice_s=0.2,
            log_every=10.0,
            log=lambda w: f"writer waiting {w:.0f}s for readers: {self._describe(socks, missing)}",
        )
        # Every local reader has mapped the ring and opened its pipes: the names can go.
        _cleanup(self.shm)
        for s in socks:
            s.send_control(READY, block=True)

    def _describe(self, socks: list[SocketSender], missing: list[set[int]]) -> str:
        parts = []
        for s, late in zip(socks, missing):
            if late and s.path == "ipc":
                parts.append(
                    f"local reader rank(s) {sorted(late)} never attached to shared memory {self.handle.shm_name or ''}"
                )
            elif late:
                parts.append(f"remote reader rank(s) {sorted(late)} never subscribed to {self.handle.remote_endpoint}")
        return "; ".join(parts)

    # -- sending -----------------------------------------------------------------------------

    def send_frames(
        self, frames: list[Any], timeout: float | None, on_wait: Callable[[], None] | None, tried: Sender | None = None
    ) -> None:
        """A message's frames to every path: `try_send` first (but on `tried`, which the caller just tried), `send`
        (waiting, up to `timeout`) only where a path lags."""
        sizes = None if self.max_message_bytes is None else self._sizes_within_limit(frames)
        deadline: float | None = None
        waited = False
        for s in self.senders:
            if s is tried or not s.try_send(frames, sizes):
                if not waited:
                    deadline, waited = deadline_of(timeout), True
                s.send(frames, sizes, deadline, on_wait)

    def _sizes_within_limit(self, frames: list[Any]) -> list[int]:
        sizes = frame_sizes(frames)
        assert self.max_message_bytes is not None
        if sum(sizes) > self.max_message_bytes:
            raise MessageTooLarge(
                f"message is {sum(sizes)} bytes, over this queue's max_message_bytes="
                f"{self.max_message_bytes}; nothing was sent"
            )
        return sizes

    def status(self) -> dict[str, Any]:
        """What a look from outside may see (another thread, racy by design): bytes per path, and the ring's
        occupancy with how many chunks each local reader has not yet read or released."""
        out: dict[str, Any] = {
            "bytes": {
                "shm": self.shm.sent_bytes if self.shm is not None else 0,
                "tcp": self.remote.sent_bytes if self.remote is not None else 0,
            }
        }
        if self.shm is not None:
            out.update(self.shm.status())
        return out

    # -- the end -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        for s in self.senders:
            s.shutdown()

    @property
    def waiters(self) -> list[Waiters]:
        return [
            w
            for s in self.senders
            for w in ([s.waiters, s.overflow.waiters] if isinstance(s, ShmSender) else [s.waiters])
        ]

    def close(self, flush: bool, flush_timeout: float | None) -> None:
        """CLOSE to every reader; a remote publisher is held until its readers confirm (lingering.py)."""
        if self.shm is not None:
            self.shm.close()
        if self.remote is not None:
            limit = settings.get("RAYFREE_CLOSE_FLUSH_S") if flush_timeout is None else max(0.0, flush_timeout)
            if flush and limit > 0:
                lingering.hold(self.remote, self.remote_reader_ranks, limit)
            else:
                self.remote.close()
        self._release()

    def abort(self) -> None:
        for s in (self.remote, self.shm):
            if s is not None:
                s.abort()
        self._release()

    def _release(self) -> None:
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
