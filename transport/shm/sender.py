"""The writer's end of the shared-memory channel: frames into the ring for the local readers, waiting when it must.

The ring protocol (ring.py) says which chunk may be written or read; this
module decides how to wait for that (spin, then park on a wake pipe, see
waiting.py, inside the channel's one wait loop), lays frames into slots
(slots.py), and sends messages too big for the whole ring over its overflow
socket (a private ipc publisher, zmq/sender.py). The reader's end is
receiver.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..channel import Sender, frame_sizes
from ..net import IpcDir
from ..zmq.sender import SocketSender
from . import slots
from .bulk import copy_into
from .ring import RingWriter
from .segment import ShmRingBuffer
from .slots import KIND_DATA, KIND_OVERFLOW
from .waiting import SpinPolicy, WakePipe, note_ring_processes, spin

__all__ = ["ShmSender"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter
_FOREVER = float("inf")


class ShmSender(Sender):
    """Writes messages into the ring for the local readers, and wakes the parked ones."""

    path = "shm"

    def __init__(
        self, ring: ShmRingBuffer, reader_ranks: list[int], spin_us: float | None, ipc: IpcDir, overflow: SocketSender
    ) -> None:
        super().__init__()
        self.ring = ring
        self.ipc = ipc
        self.readers = reader_ranks
        self.rw = RingWriter(ring)
        #: where messages too big for the whole ring go (READY and CLOSE too)
        self.overflow = overflow
        wake_dir = ipc.path
        paths = [os.path.join(wake_dir, "wake-w")] + [
            os.path.join(wake_dir, f"wake-r{i}") for i in range(ring.n_reader)
        ]
        for path in paths:
            WakePipe.create(path)
        self.own = WakePipe(paths[0], waiter=True)
        self._self_waker = WakePipe(paths[0], waiter=False)
        self.reader_pipes = [WakePipe(path, waiter=False) for path in paths[1:]]
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        #: bytes this path has carried (the overflow socket's included), for metrics
        self.sent_bytes = 0
        self._base_addr = ring.address
        #: `RingWriter.put_one` (ring.py), bound once for `try_send`'s one-chunk message (the hot path)
        self._put_one = self.rw.put_one
        #: `WakePipe.wake` of the one reader's pipe (waiting.py), when there is one reader
        self._wake_one = self.reader_pipes[0].wake if ring.n_reader == 1 else None

    @classmethod
    def create(
        cls, reader_ranks: list[int], max_chunk_bytes: int, max_chunks: int, queue_id: bytes, spin_us: float | None
    ) -> ShmSender:
        """A new ring for `reader_ranks`, its wake pipes and its overflow publisher (all removed on failure)."""
        ring = ShmRingBuffer.create(len(reader_ranks), max_chunk_bytes, max_chunks, queue_id)
        ipc = overflow = None
        try:
            ipc = IpcDir()
            overflow = SocketSender.publish(ipc.endpoint("overflow"), "ipc", reader_ranks, 0, queue_id)
            return cls(ring, reader_ranks, spin_us, ipc, overflow)
        except BaseException:
            if overflow is not None:
                overflow.abort()
            if ipc is not None:
                ipc.remove()
            ring.unlink()
            ring.close()
            raise

    def names(self) -> dict[str, Any]:
        """What a local reader needs to find this path (for the queue's handle)."""
        return {
            "shm_name": self.ring.name,
            "shm_size": self.ring.size,
            "ipc_dir": self.ipc.path,
            "local_endpoint": self.overflow.endpoint,
        }

    def remove_names(self) -> None:
        """Remove the segment's and the pipes' names (every reader has opened them; idempotent)."""
        self.ring.unlink()
        self.ipc.remove()

    # -- sending -------------------------------------------------------------------------------

    def try_send(self, frames: list[Any], sizes: list[int] | None = None) -> bool:
        if len(frames) == 1:
            data = frames[0]
            done = self._put_one(data)
            if done:
                self.sent_bytes += len(data)
                if done == 2:
                    self.wake_parked()
                return True
        if sizes is None:
            sizes = frame_sizes(frames)
        nbytes = slots.layout(sizes)[1]
        if nbytes > self.ring.capacity:
            return False
        span = self.rw.span_for(nbytes)
        start = self._try_reserve(span)
        if start is None:
            return False
        self._write(start, span, frames, sizes)
        return True

    def send(
        self,
        frames: list[Any],
        sizes: list[int] | None,
        deadline: float | None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        if sizes is None:
            sizes = frame_sizes(frames)
        nbytes = slots.layout(sizes)[1]
        if nbytes > self.ring.capacity:
            self._send_overflow(frames, sizes, deadline, on_wait)
            return
        span = self.rw.span_for(nbytes)
        self._write(self._reserve(span, deadline, on_wait), span, frames, sizes)

    def _write(self, start: int, span: int, frames: list[Any], sizes: list[int]) -> None:
        base = self.ring.chunk_offset(start)
        buf = self.ring.buf
        if len(frames) == 1:
            slots.write_one(buf, base, KIND_DATA, span, frames[0])
        else:
            slots.write_head(buf, base, KIND_DATA, span, sizes)
            offsets, _ = slots.layout(sizes)
            buf[base + offsets[0] : base + offsets[0] + sizes[0]] = frames[0]
            for f, off in zip(frames[1:], offsets[1:]):
                copy_into(buf, self._base_addr, base + off, f)
        self.rw.commit(start, span)
        self.sent_bytes += sum(sizes)
        self._notify()

    def _send_overflow(
        self, frames: list[Any], sizes: list[int], deadline: float | None, on_wait: Callable[[], None] | None
    ) -> None:
        """Mark the next slot 'on the overflow socket', send there, then publish the mark."""
        start = self._reserve(1, deadline, on_wait)
        slots.write_head(self.ring.buf, self.ring.chunk_offset(start), KIND_OVERFLOW, 1, [0])
        self.overflow.send(frames, sizes, deadline, on_wait)
        self.rw.commit(start, 1)
        self.sent_bytes += sum(sizes)
        self._notify()

    def wake_parked(self) -> None:
        if self._wake_one is not None:
            self._wake_one()
            return
        for r in self.rw.parked_readers():
            self.reader_pipes[r].wake()

    def _notify(self) -> None:
        if self.rw.readers_parked():
            self.wake_parked()

    def _try_reserve(self, span: int) -> int | None:
        rw = self.rw
        start = rw.try_reserve(span)
        if rw.wrapped:  # readers parked at the old position can move on to chunk 0
            rw.wrapped = False
            self._notify()
        return start

    def _reserve(self, span: int, deadline: float | None, on_wait: Callable[[], None] | None = None) -> int:
        start = self._try_reserve(span)
        if start is not None:
            return start
        rw, pol = self.rw, self.policy
        t0 = _perf()
        with self.waiters:
            start = spin(lambda: self._try_reserve(span), pol)
            if start is not None:
                return start

            def attempt(s: float) -> int | None:
                rw.set_parked(1)
                got = self._try_reserve(span)
                if got is None and s > 0:
                    self.own.wait(s)
                    got = self._try_reserve(span)
                rw.set_parked(0)
                if got is not None:
                    pol.record(_perf() - t0)
                return got

            return self.wait(
                attempt,
                deadline,
                "enqueue",
                lambda _: f" waiting for a free slot: {self.laggards(span)}",
                slice_s=_FOREVER,
                on_wait=on_wait,
                t0=t0,
                log_level=logging.WARNING,
                log=lambda w: f"writer has waited {w:.0f}s for a free slot: {self.laggards(span)}",
            )

    def laggards(self, span: int) -> str:
        late = sorted({self.readers[r] for c in self.rw.blocking_chunks(span) for r in self.rw.holders(c)})
        return f"local reader rank(s) {late} have not read (or still hold in-place views of) earlier messages"

    def status(self) -> dict[str, Any]:
        """The ring's occupancy, and how many chunks each local reader has not yet read or released."""
        if self.shutdown_requested:
            return {}
        rw = self.rw
        behind = dict.fromkeys(self.readers, 0)
        occupied = 0
        try:
            for c in range(self.ring.n_chunks):
                held = rw.holders(c)
                occupied += bool(held)
                for r in held:
                    behind[self.readers[r]] += 1
        except ValueError:  # closed meanwhile (the mapping is released): nothing to show
            return {}
        return {"chunks": self.ring.n_chunks, "occupied": occupied, "behind": behind}

    # -- the end ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        super().shutdown()
        self.overflow.shutdown()
        self._self_waker.wake()  # a send parked for a free chunk sees it now

    def close(self) -> None:
        """Tell readers no more messages come (on the ring and its socket), wake them, release the pipes."""
        self.rw.mark_closed()
        for p in self.reader_pipes:
            p.wake()
        for p in (self.own, self._self_waker, *self.reader_pipes):
            p.close()
        self.overflow.close()
        self._release()

    def abort(self) -> None:
        self.overflow.abort()
        self.rw.mark_closed()
        for p in (self.own, self._self_waker, *self.reader_pipes):
            p.close()
        self._release()

    def _release(self) -> None:
        self.remove_names()
        self.ring.close()
