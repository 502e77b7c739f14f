"""The shared-memory channel of a MessageQueue: frames into the ring and back out, waiting when it must.

The ring protocol (ring.py) says which chunk may be written or read; this
module decides how to wait for that (spin, then park on a wake pipe, see
waiting.py), lays frames into slots (framing.py), and sends messages too big
for the whole ring over its overflow socket (a private ipc publisher).

Every message is unpickled from the ring and its chunks freed at once: each
reader gets its own writable copy of every out-of-band buffer (tensors,
arrays), so one reader's in-place change is never seen by another and a
tensor kept for any time never holds the writer back. Buffers of at least
RAYFREE_POOL_MIN_BYTES are copied (on several cores when big) into warm
memory from the reader's pool (pool.py). A reader made with `zero_copy=True`
instead gets its big payloads *in place*, as views of the ring: it promises
to treat them as read-only (every local reader sees the same bytes) and not
to keep them (a held view keeps its chunks from the writer).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import time
import weakref
from typing import Any, Callable

from rayfree import settings

from . import framing
from .channel import Receiver, Sender
from .copier import copy_into
from .errors import BadFrame, QueueClosed, QueueShutdown, QueueTimeout
from .framing import KIND_BYTES, KIND_DATA, KIND_OVERFLOW, ONE_FRAME_OFFSET
from .pool import BufferPool
from .ring import EMPTY, RingReader, RingWriter
from .shm_ring import ShmRingBuffer
from .waiting import SpinPolicy, Waiters, WakePipe, note_ring_processes, spin
from .zmq_channel import SocketReceiver, SocketSender

__all__ = ["ShmSender", "ShmReceiver"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter
_loads = pickle.loads


class ShmSender(Sender):
    """Writes messages into the ring for the local readers, and wakes the parked ones."""

    path = "shm"

    def __init__(self, ring: ShmRingBuffer, reader_ranks: list[int], spin_us: float | None, wake_dir: str,
                 overflow: SocketSender) -> None:
        self.ring = ring
        self.readers = reader_ranks
        self.rw = RingWriter(ring)
        self.overflow = overflow
        paths = [os.path.join(wake_dir, "wake-w")] + [os.path.join(wake_dir, f"wake-r{i}")
                                                       for i in range(ring.n_reader)]
        for path in paths:
            WakePipe.create(path)
        self.own = WakePipe(paths[0], waiter=True)
        self._self_waker = WakePipe(paths[0], waiter=False)
        self.reader_pipes = [WakePipe(path, waiter=False) for path in paths[1:]]
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        self.shutdown_requested = False
        self.waiters = Waiters()
        self.log_interval = settings.get("RAYFREE_WAIT_LOG_INTERVAL_S")
        self._base_addr = ring.address
        self._wake_one = self.reader_pipes[0].wake if ring.n_reader == 1 else None

    def put_one(self, data: bytes, kind: int = KIND_DATA) -> bool:
        """A one-frame message into the next chunk if it is free (the hot path); False: use `send`."""
        done = self.rw.put_one(data, kind)
        if done == 2:
            self.wake_parked()
        return done != 0

    def send(self, frames: list, sizes: list[int], deadline: float | None,
             on_wait: Callable[[], None] | None = None) -> None:
        nbytes = framing.layout(sizes)[1]
        if nbytes > self.ring.capacity:
            self._send_overflow(frames, sizes, deadline, on_wait)
            return
        if len(frames) == 1 and self.put_one(frames[0], KIND_DATA):
            return
        rw = self.rw
        span = rw.span_for(nbytes)
        start = self._reserve(span, deadline, on_wait)
        base = self.ring.chunk_offset(start)
        buf = self.ring.buf
        if len(frames) == 1:
            framing.write_one(buf, base, KIND_DATA, span, frames[0])
        else:
            framing.write_head(buf, base, KIND_DATA, span, sizes)
            offsets, _ = framing.layout(sizes)
            buf[base + offsets[0]: base + offsets[0] + sizes[0]] = frames[0]
            for f, off in zip(frames[1:], offsets[1:]):
                copy_into(buf, self._base_addr, base + off, f)
        rw.commit(start, span)
        self._notify()

    def _send_overflow(self, frames: list, sizes: list[int], deadline: float | None,
                       on_wait: Callable[[], None] | None) -> None:
        """Mark the next slot 'on the overflow socket', send there, then publish the mark."""
        start = self._reserve(1, deadline, on_wait)
        framing.write_head(self.ring.buf, self.ring.chunk_offset(start), KIND_OVERFLOW, 1, [0])
        self.overflow.send(frames, sizes, deadline, on_wait)
        self.rw.commit(start, 1)
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
        with self.waiters:
            t0 = _perf()
            start = spin(lambda: self._try_reserve(span), self.policy)
            return start if start is not None else self._park(span, deadline, t0, on_wait)

    def _park(self, span: int, deadline: float | None, t0: float, on_wait: Callable[[], None] | None) -> int:
        rw, pol = self.rw, self.policy
        next_log = t0 + self.log_interval
        while True:
            rw.set_parked(1)
            start = self._try_reserve(span)
            now = _perf()
            if start is not None:
                rw.set_parked(0)
                pol.record(now - t0)
                return start
            if self.shutdown_requested:
                rw.set_parked(0)
                raise QueueShutdown("enqueue interrupted: shutdown() was called on this queue")
            if deadline is not None and now >= deadline:
                rw.set_parked(0)
                raise QueueTimeout(f"enqueue timed out after {now - t0:.3f}s waiting for a free slot: "
                                   f"{self.laggards(span)}")
            if now >= next_log:
                logger.warning("writer has waited %.0fs for a free slot: %s", now - t0, self.laggards(span))
                next_log = now + self.log_interval
            left = next_log - now if deadline is None else min(deadline, next_log) - now
            self.own.wait(left if on_wait is None else min(left, 0.005))
            rw.set_parked(0)
            if on_wait is not None:
                on_wait()

    def laggards(self, span: int) -> str:
        late = sorted({self.readers[r] for c in self.rw.blocking_chunks(span) for r in self.rw.holders(c)})
        return (f"local reader rank(s) {late} have not read (or still hold in-place views of) "
                f"earlier messages")

    def shutdown(self) -> None:
        self.shutdown_requested = True
        self._self_waker.wake()  # a send parked for a free chunk sees it now

    def close(self) -> None:
        """Tell readers no more messages come, wake them, release the pipes."""
        self.rw.mark_closed()
        for p in self.reader_pipes:
            p.wake()
        for p in (self.own, self._self_waker, *self.reader_pipes):
            p.close()

    abort = close


class ShmReceiver(Receiver):
    """Local reader `r`: waits for its next slot and turns it back into an object."""

    path = "shm"

    def __init__(self, ring: ShmRingBuffer, r: int, spin_us: float | None, wake_dir: str,
                 zero_copy: bool = False) -> None:
        self.ring = ring
        self.zero_copy = zero_copy
        #: where messages too big for the ring arrive (set by the owner once subscribed)
        self.overflow: SocketReceiver | None = None
        path = os.path.join(wake_dir, f"wake-r{r}")
        self.own = WakePipe(path, waiter=True)
        self._self_waker = WakePipe(path, waiter=False)
        self.writer_pipe = WakePipe(os.path.join(wake_dir, "wake-w"), waiter=False)
        self.rr = RingReader(ring, r, _loads, self.writer_pipe.wake)
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        self.shutdown_requested = False
        self.waiters = Waiters()
        self.log_interval = settings.get("RAYFREE_WAIT_LOG_INTERVAL_S")
        self.pool_min = settings.get("RAYFREE_POOL_MIN_BYTES")
        self.pool = BufferPool(settings.get("RAYFREE_READER_POOL_BYTES"))
        self._base_addr = ring.address
        self._holders: dict[int, type] = {}
        self._leases: dict[int, weakref.ref] = {}
        #: the hot path: the next one-chunk message, or EMPTY
        self.get_one = self.rr.get_one

    def recv(self, timeout: float | None, indefinite: bool) -> Any:
        obj = self.rr.get_one()
        if obj is not EMPTY:
            return obj
        rr = self.rr
        t0 = _perf()
        deadline = None if timeout is None else t0 + timeout  # one deadline for every stage below
        if not rr.ready():
            with self.waiters:
                if not rr.spin_ready(self.policy):
                    self._park(t0, deadline, indefinite)
        obj = rr.get_one()
        if obj is not EMPTY:
            return obj
        start, kind, span = self._next_slot(deadline, indefinite)
        if kind != KIND_OVERFLOW:
            return self._read(start, span)
        rr.release(start, span)
        assert self.overflow is not None
        return self.overflow.recv(None if deadline is None else max(0.0, deadline - _perf()), indefinite)

    def _next_slot(self, deadline: float | None, indefinite: bool) -> tuple[int, int, int]:
        got = self.rr.poll()
        if got is not None:
            return got
        with self.waiters:
            rr = self.rr
            got = spin(rr.poll, self.policy)
            while got is None:  # readable can be a WRAP marker whose next message is not out yet: park again
                self._park(_perf(), deadline, indefinite)
                got = rr.poll()
            return got

    def _park(self, t0: float, deadline: float | None, indefinite: bool) -> None:
        rr, pol = self.rr, self.policy
        next_log = t0 + self.log_interval
        while True:
            rr.set_parked(1)
            ready = rr.ready()
            now = _perf()
            if ready:
                rr.set_parked(0)
                pol.record(now - t0)
                return
            if self.shutdown_requested:
                rr.set_parked(0)
                raise QueueShutdown("dequeue interrupted: shutdown() was called on this queue")
            if rr.closed:
                rr.set_parked(0)
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            if deadline is not None and now >= deadline:
                rr.set_parked(0)
                raise QueueTimeout(f"dequeue timed out after {now - t0:.3f}s: no message from the writer")
            if now >= next_log:
                if not indefinite:
                    logger.info("reader %d has waited %.0fs for a message", rr.r, now - t0)
                next_log = now + self.log_interval
            if deadline is not None:
                self.own.wait(min(deadline, next_log) - now)
            else:
                self.own.wait(None if indefinite else next_log - now)
            rr.set_parked(0)

    def _read(self, start: int, span: int) -> Any:
        """Unpickle the message in chunks start.. and free them (now, or when its views die)."""
        ring, rr = self.ring, self.rr
        buf = ring.buf
        base = ring.chunk_offset(start)
        limit = span * ring.stride
        n0 = framing.read_one_length(buf, base)
        if n0 >= 0:
            try:
                if ONE_FRAME_OFFSET + n0 > limit:
                    raise BadFrame(f"corrupt slot: a {n0}-byte frame in a {limit}-byte slot")
                if buf[base] == KIND_BYTES:
                    return bytes(buf[base + ONE_FRAME_OFFSET: base + ONE_FRAME_OFFSET + n0])
                return _loads(buf[base + ONE_FRAME_OFFSET: base + ONE_FRAME_OFFSET + n0])
            finally:
                rr.release(start, span)
        try:
            offsets, lengths = framing.read_layout(buf, base, limit)
        except BadFrame:
            rr.release(start, span)
            raise
        if self.zero_copy and max(lengths[1:]) >= self.pool_min:
            return self._read_in_place(start, span, base, offsets, lengths)
        try:
            bufs = [self._private(buf, base + o, n) for o, n in zip(offsets[1:], lengths[1:])]
            return _loads(buf[base + offsets[0]: base + offsets[0] + lengths[0]], buffers=bufs)
        finally:
            rr.release(start, span)

    def _private(self, buf: memoryview, off: int, n: int) -> Any:
        """This reader's own writable copy of buf[off:off+n]."""
        if n < self.pool_min:
            return bytearray(buf[off: off + n])  # small: the allocator hands back warm memory by itself
        view, addr = self.pool.take(n)
        copy_into(view, addr, 0, buf[off: off + n])
        return view

    def _read_in_place(self, start: int, span: int, base: int, offsets: list[int], lengths: list[int]) -> Any:
        # The payload views hang off one ctypes object per message; when the
        # last view dies, so does it, and its weakref callback frees the chunks.
        nbytes = span * self.ring.stride
        htype = self._holders.get(nbytes)
        if htype is None:
            htype = self._holders[nbytes] = ctypes.c_char * nbytes
        holder = htype.from_buffer(self.ring._mm, base)
        key = id(holder)
        release = self.rr.release
        leases = self._leases

        def _done(_ref, start=start, span=span, key=key):
            leases.pop(key, None)
            release(start, span)

        leases[key] = weakref.ref(holder, _done)
        hv = bufs = None
        try:
            hv = memoryview(holder).cast("B")
            bufs = [hv[o: o + n] for o, n in zip(offsets[1:], lengths[1:])]
            obj = _loads(hv[offsets[0]: offsets[0] + lengths[0]], buffers=bufs)
        finally:
            hv = bufs = None
            del holder
        return obj

    def shutdown(self) -> None:
        self.shutdown_requested = True
        if self.overflow is not None:
            self.overflow.shutdown()
        self._self_waker.wake()

    def close(self) -> None:
        """The pipes; the owner closes the overflow socket."""
        for p in (self.own, self._self_waker, self.writer_pipe):
            p.close()
