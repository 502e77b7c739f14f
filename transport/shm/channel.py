"""The shared-memory channel of a MessageQueue: frames into the ring and back out, waiting when it must.

The ring protocol (ring.py) says which chunk may be written or read; this
module decides how to wait for that (spin, then park on a wake pipe, see
waiting.py, inside the channel's one wait loop), lays frames into slots
(slots.py), and sends messages too big for the whole ring over its overflow
socket (a private ipc publisher, zmq/channel.py).

Every message is unpickled from the ring and its chunks freed at once: each
reader gets its own writable copy of every out-of-band buffer (tensors,
arrays), so one reader's in-place change is never seen by another and a
tensor kept for any time never holds the writer back. Buffers of at least
RAYFREE_POOL_MIN_BYTES are copied (on several cores when big) into warm
memory from the reader's pool (bulk.py). A reader made with `zero_copy=True`
instead gets its big payloads *in place*, as views of the ring: it promises
to treat them as read-only (every local reader sees the same bytes) and not
to keep them (a held view keeps its chunks from the writer).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import weakref
from typing import Any, Callable

from rayfree import settings
from rayfree.transport import serde
from rayfree.transport.channel import EMPTY, Receiver, Sender, frame_sizes
from rayfree.transport.errors import BadFrame, QueueClosed
from rayfree.transport.net import IpcDir
from rayfree.transport.shm import slots
from rayfree.transport.shm.bulk import BufferPool, copy_into
from rayfree.transport.shm.ring import RingReader, RingWriter
from rayfree.transport.shm.segment import ShmRingBuffer
from rayfree.transport.shm.slots import KIND_DATA, KIND_OVERFLOW, ONE_FRAME_OFFSET
from rayfree.transport.shm.waiting import SpinPolicy, WakePipe, note_ring_processes, spin
from rayfree.transport.zmq.channel import SocketReceiver, SocketSender

__all__ = ["ShmSender", "ShmReceiver"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter
_loads = serde.loads
_FOREVER = float("inf")


class ShmSender(Sender):
    """Writes messages into the ring for the local readers, and wakes the parked ones."""

    path = "shm"

    def __init__(self, ring: ShmRingBuffer, reader_ranks: list[int], spin_us: float | None, ipc: IpcDir,
                 overflow: SocketSender) -> None:
        super().__init__()
        self.ring = ring
        self.ipc = ipc
        self.readers = reader_ranks
        self.rw = RingWriter(ring)
        #: where messages too big for the whole ring go (READY and CLOSE too)
        self.overflow = overflow
        wake_dir = ipc.path
        paths = [os.path.join(wake_dir, "wake-w")] + [os.path.join(wake_dir, f"wake-r{i}")
                                                       for i in range(ring.n_reader)]
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
        self._put_one = self.rw.put_one
        self._wake_one = self.reader_pipes[0].wake if ring.n_reader == 1 else None

    @classmethod
    def create(cls, reader_ranks: list[int], max_chunk_bytes: int, max_chunks: int, queue_id: bytes,
               spin_us: float | None) -> ShmSender:
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
        return {"shm_name": self.ring.name, "shm_size": self.ring.size, "ipc_dir": self.ipc.path,
                "local_endpoint": self.overflow.endpoint}

    def remove_names(self) -> None:
        """Remove the segment's and the pipes' names (every reader has opened them; idempotent)."""
        self.ring.unlink()
        self.ipc.remove()

    # -- sending -------------------------------------------------------------------------------

    def try_send(self, frames: list[Any], sizes: list[int] | None = None) -> bool:
        if len(frames) == 1:
            done = self._put_one(frames[0])
            if done:
                self.sent_bytes += len(frames[0])
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

    def send(self, frames: list[Any], sizes: list[int] | None, deadline: float | None,
             on_wait: Callable[[], None] | None = None) -> None:
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
            buf[base + offsets[0]: base + offsets[0] + sizes[0]] = frames[0]
            for f, off in zip(frames[1:], offsets[1:]):
                copy_into(buf, self._base_addr, base + off, f)
        self.rw.commit(start, span)
        self.sent_bytes += sum(sizes)
        self._notify()

    def _send_overflow(self, frames: list[Any], sizes: list[int], deadline: float | None,
                       on_wait: Callable[[], None] | None) -> None:
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

            return self.wait(attempt, deadline, "enqueue", lambda _: f" waiting for a free slot: {self.laggards(span)}",
                             slice_s=_FOREVER, on_wait=on_wait, t0=t0, log_level=logging.WARNING,
                             log=lambda w: f"writer has waited {w:.0f}s for a free slot: {self.laggards(span)}")

    def laggards(self, span: int) -> str:
        late = sorted({self.readers[r] for c in self.rw.blocking_chunks(span) for r in self.rw.holders(c)})
        return (f"local reader rank(s) {late} have not read (or still hold in-place views of) "
                f"earlier messages")

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


class ShmReceiver(Receiver):
    """Local reader `r`: waits for its next slot and turns it back into an object."""

    path = "shm"

    def __init__(self, ring: ShmRingBuffer, r: int, spin_us: float | None, wake_dir: str,
                 subscribe: Callable[[], SocketReceiver], zero_copy: bool = False) -> None:
        super().__init__()
        self.ring = ring
        self.zero_copy = zero_copy
        # The wake pipes first: the writer removes their directory once every hello has arrived.
        path = os.path.join(wake_dir, f"wake-r{r}")
        self.own = WakePipe(path, waiter=True)
        self._self_waker = WakePipe(path, waiter=False)
        self.writer_pipe = WakePipe(os.path.join(wake_dir, "wake-w"), waiter=False)
        try:
            #: where messages too big for the ring arrive (and READY and CLOSE)
            self.overflow = subscribe()
        except BaseException:
            for p in (self.own, self._self_waker, self.writer_pipe):
                p.close()
            raise
        self.rr = RingReader(ring, r, _loads, self.writer_pipe.wake)
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        self.pool_min = settings.get("RAYFREE_POOL_MIN_BYTES")
        self.pool = BufferPool(settings.get("RAYFREE_READER_POOL_BYTES"))
        self._base_addr = ring.address
        self._holders: dict[int, type] = {}
        self._leases: dict[int, weakref.ref[Any]] = {}
        self._get_one = self.rr.get_one

    @classmethod
    def attach(cls, shm_name: str, shm_size: int, queue_id: str, r: int, wake_dir: str, endpoint: str,
               rank: int, spin_us: float | None, zero_copy: bool, maxmsgsize: int | None) -> ShmReceiver:
        """Map the writer's ring as its reader `r` and subscribe to its overflow socket."""
        ring = ShmRingBuffer.attach(shm_name, shm_size, queue_id)
        try:
            return cls(ring, r, spin_us, wake_dir,
                       lambda: SocketReceiver.subscribe(endpoint, "ipc", rank, queue_id, maxmsgsize), zero_copy)
        except BaseException:
            ring.close()
            raise

    def try_recv(self) -> Any:
        obj = self._get_one()
        if obj is not EMPTY or not self.rr.ready():
            return obj
        got = self.rr.poll()
        return EMPTY if got is None else self._take(got, None, False)

    def recv_waiting(self, deadline: float | None, indefinite: bool) -> Any:
        rr = self.rr
        if not rr.ready():
            t0 = _perf()
            with self.waiters:
                if not rr.spin_ready(self.policy):
                    self._park(t0, deadline, indefinite)
        obj = self._get_one()
        if obj is not EMPTY:
            return obj
        return self._take(self._next_slot(deadline, indefinite), deadline, indefinite)

    def recv_control(self, deadline: float | None, what: str) -> list[Any]:
        """The handshake's READY (it comes on the overflow socket)."""
        return self.overflow.recv_control(deadline, what)

    def _take(self, got: tuple[int, int, int], deadline: float | None, indefinite: bool) -> Any:
        start, kind, span = got
        if kind != KIND_OVERFLOW:
            return self._read(start, span)
        self.rr.release(start, span)
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

        def attempt(s: float) -> bool | None:
            rr.set_parked(1)
            ready = rr.ready()
            if not ready and not rr.closed and s > 0:
                self.own.wait(s)
                ready = rr.ready()
            rr.set_parked(0)
            if ready:
                pol.record(_perf() - t0)
                return True
            if rr.closed:
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            return None

        self.wait(attempt, deadline, "dequeue", lambda _: ": no message from the writer", slice_s=_FOREVER, t0=t0,
                  log=None if indefinite else (lambda w: f"reader {rr.r} has waited {w:.0f}s for a message"))

    def _read(self, start: int, span: int) -> Any:
        """Unpickle the message in chunks start.. and free them (now, or when its views die)."""
        ring, rr = self.ring, self.rr
        buf = ring.buf
        base = ring.chunk_offset(start)
        limit = span * ring.stride
        n0 = slots.read_one_length(buf, base)
        if n0 >= 0:
            try:
                if ONE_FRAME_OFFSET + n0 > limit:
                    raise BadFrame(f"corrupt slot: a {n0}-byte frame in a {limit}-byte slot")
                return _loads(buf[base + ONE_FRAME_OFFSET: base + ONE_FRAME_OFFSET + n0])
            finally:
                rr.release(start, span)
        try:
            offsets, lengths = slots.read_layout(buf, base, limit)
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
        super().shutdown()
        self.overflow.shutdown()
        self._self_waker.wake()

    def close(self) -> None:
        """The pipes, the overflow socket and the mapping."""
        for p in (self.own, self._self_waker, self.writer_pipe):
            p.close()
        self.overflow.close()
        self.ring.close()
