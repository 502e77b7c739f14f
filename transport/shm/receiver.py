"""The reader's end of the shared-memory channel: a local reader's slots turned back into objects.

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
import os
import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

from rayfree import settings

from .. import serde
from ..channel import EMPTY, Receiver
from ..errors import BadFrame, QueueClosed
from ..zmq.receiver import SocketReceiver
from . import slots
from .bulk import BufferPool, copy_into
from .ring import RingReader
from .segment import ShmRingBuffer
from .slots import KIND_OVERFLOW, ONE_FRAME_OFFSET
from .waiting import NAP_MIN_S, SpinPolicy, WakePipe, note_ring_processes, spin

__all__ = ["ShmReceiver"]

_perf = time.perf_counter
_loads = serde.loads
_FOREVER = float("inf")


class ShmReceiver(Receiver):
    """Local reader `r`: waits for its next slot and turns it back into an object."""

    path = "shm"

    def __init__(
        self,
        ring: ShmRingBuffer,
        r: int,
        spin_us: float | None,
        wake_dir: str,
        subscribe: Callable[[], SocketReceiver],
        zero_copy: bool = False,
    ) -> None:
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
        self.rr = RingReader(ring, r, pickle.loads, self.writer_pipe.wake)
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        self.pool_min = settings.get("RAYFREE_POOL_MIN_BYTES")
        self.pool = BufferPool(settings.get("RAYFREE_READER_POOL_BYTES"))
        self._base_addr = ring.address
        self._holders: dict[int, type] = {}
        self._leases: dict[int, weakref.ref[Any]] = {}
        #: `RingReader.get_one` (ring.py), bound once for `try_recv`'s one-chunk message (the hot path)
        self._get_one = self.rr.get_one

    @classmethod
    def attach(
        cls,
        shm_name: str,
        shm_size: int,
        queue_id: str,
        r: int,
        wake_dir: str,
        endpoint: str,
        rank: int,
        spin_us: float | None,
        zero_copy: bool,
        maxmsgsize: int | None,
    ) -> ShmReceiver:
        """Map the writer's ring as its reader `r` and subscribe to its overflow socket."""
        ring = ShmRingBuffer.attach(shm_name, shm_size, queue_id)
        try:
            return cls(
                ring,
                r,
                spin_us,
                wake_dir,
                lambda: SocketReceiver.subscribe(endpoint, "ipc", rank, queue_id, maxmsgsize),
                zero_copy,
            )
        except BaseException:
            ring.close()
            raise

    def recv(self, timeout: float | None, indefinite: bool = False) -> Any:
        # The hot path first, without the base class's call in between.
        obj = self._get_one()
        if obj is not EMPTY:
            return obj
        obj = self.try_recv()
        if obj is not EMPTY:
            return obj
        return self.recv_waiting(None if timeout is None else _perf() + max(0.0, timeout), indefinite)

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
                if not rr.spin_ready(self.policy) and not self._nap(t0, deadline):
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

    def _nap(self, t0: float, deadline: float | None) -> bool:
        """Steady steps (SpinPolicy.expect): sleep until just before the next message is due (parked: one that
        comes sooner wakes it), then spin a little: is the head there? (False: park as usual.)"""
        rr, pol = self.rr, self.policy
        nap, spin_s = pol.expect()
        if spin_s <= 0 or rr.closed:
            return False
        if deadline is not None:
            nap = min(nap, deadline - t0)
        due = t0 + nap
        if due - _perf() > NAP_MIN_S:
            rr.set_parked(1)
            if not rr.ready() and not self.own.nap(max(0.0, due - _perf())):
                pol.record_nap(_perf() - due)
            rr.set_parked(0)
            if rr.ready():
                pol.record(_perf() - t0)
                return True
        return rr.spin_ready(pol, spin_s, t0)

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

        self.wait(
            attempt,
            deadline,
            "dequeue",
            lambda _: ": no message from the writer",
            slice_s=_FOREVER,
            t0=t0,
            log=None if indefinite else (lambda w: f"reader {rr.r} has waited {w:.0f}s for a message"),
        )

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
                return _loads(buf[base + ONE_FRAME_OFFSET : base + ONE_FRAME_OFFSET + n0])
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
            return _loads(buf[base + offsets[0] : base + offsets[0] + lengths[0]], buffers=bufs)
        finally:
            rr.release(start, span)

    def _private(self, buf: memoryview, off: int, n: int) -> Any:
        """This reader's own writable copy of buf[off:off+n]."""
        if n < self.pool_min:
            return bytearray(buf[off : off + n])  # small: the allocator hands back warm memory by itself
        view, addr = self.pool.take(n)
        copy_into(view, addr, 0, buf[off : off + n])
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
            bufs = [hv[o : o + n] for o, n in zip(offsets[1:], lengths[1:])]
            obj = _loads(hv[offsets[0] : offsets[0] + lengths[0]], buffers=bufs)
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
