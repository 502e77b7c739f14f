"""The shared-memory half of a MessageQueue: writing frames into the ring, reading them out.

Small messages are unpickled straight from the ring and their chunks freed at
once. A message with an out-of-band buffer of at least `INPLACE_MIN_BYTES`
is handed to the reader *in place*: tensors are views of the ring, and its
chunks are freed when the last such view dies. Readers must treat those
payloads as read-only (other readers see the same bytes) and `.clone()`
what they keep for long, since a held view keeps its chunks from the writer.

`put_one` / `get_one` are the hot path (one frame in one chunk: a small
pickle stream or a raw bytes message, the common case for control messages
and replies); everything else takes the general path. They inline the ring
protocol of shm_ring.py, whose docstring explains it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import struct
import time
import weakref
from typing import Any, Callable

from . import framing
from .copier import copy_into
from .errors import BadFrame, QueueClosed, QueueShutdown, QueueTimeout
from .shm_ring import (_READER_PARKED, _WRITER_PARKED, KIND_BYTES, KIND_DATA, KIND_OVERFLOW, RingReader, RingWriter,
                       ShmRingBuffer)
from . import waiting
from .waiting import SpinPolicy, Waiters, WakePipe, fence, note_ring_processes, sched_yield, spin
from .waiting import _fence_acquire as _acquire
from .waiting import _fence_release as _release

logger = logging.getLogger("rayfree.transport")

#: Out-of-band buffers at least this big are read in place instead of copied.
INPLACE_MIN_BYTES = int(os.environ.get("RAYFREE_INPLACE_MIN_BYTES", str(1 << 20)))
#: How often a long wait says so in the log.
WAIT_LOG_INTERVAL_S = float(os.environ.get("RAYFREE_WAIT_LOG_INTERVAL_S", "60"))

_perf = time.perf_counter
_ONE = struct.Struct("<BxxxIIxxxxQ")
_ONE_OFF = framing.ONE_FRAME_OFFSET
_loads = pickle.loads
EMPTY = object()


class ShmWriter:
    """Writes frames into the ring and wakes parked readers."""

    def __init__(self, ring: ShmRingBuffer, reader_ranks: list[int], spin_us: float | None,
                 wake_dir: str) -> None:
        self.ring = ring
        self.rw = RingWriter(ring)
        self.wake_paths = [os.path.join(wake_dir, "wake-w")] + [
            os.path.join(wake_dir, f"wake-r{i}") for i in range(ring.n_reader)]
        for path in self.wake_paths:
            WakePipe.create(path)
        self.own = WakePipe(self.wake_paths[0], waiter=True)
        self.readers = [WakePipe(path, waiter=False) for path in self.wake_paths[1:]]
        note_ring_processes(1 + ring.n_reader)
        self.reader_ranks = reader_ranks
        self.policy = SpinPolicy(spin_us)
        self.shutdown_requested = False
        self.waiters = Waiters()
        n = ring.n_reader
        self._flag_offs = ring.flag_offs
        self._chunk_offs = ring.chunk_offs
        self._one_max = ring.stride - _ONE_OFF
        self._parked = slice(_READER_PARKED, _READER_PARKED + n)
        self._base_addr = ring.address
        self._b = ring.buf
        self._single = n == 1
        self._row = ring._row
        self._n_chunks = ring.n_chunks
        self._all_read = ring._all_read
        self._fresh = ring._fresh
        self._no_parked = ring._no_parked

    def put_one(self, data: bytes, kind: int = KIND_DATA) -> bool:
        """Write a one-frame message into the next chunk if it is free; False means 'use `write`'.

        `kind` is KIND_DATA for a pickle stream or KIND_BYTES for a bytes
        message sent as is (the reader skips unpickling).
        """
        rw = self.rw
        c = rw.idx
        b = self._b
        fo = self._flag_offs[c]
        n = len(data)
        if n > self._one_max:
            return False
        if self._single:  # one reader (every reply queue): bytes, not slices
            if b[fo] and b[fo + 1] != 1:
                return False
            base = self._chunk_offs[c]
            _ONE.pack_into(b, base, kind, 1, 1, n)
            b[base + _ONE_OFF: base + _ONE_OFF + n] = data
            b[fo] = 1
            b[fo + 1] = 0
            c += 1
            rw.idx = 0 if c == self._n_chunks else c
            _acquire()
            _release()
            if b[_READER_PARKED]:
                self.readers[0].wake()
            return True
        row = self._row
        if b[fo] and b[fo + 1: fo + row] != self._all_read:
            return False
        base = self._chunk_offs[c]
        _ONE.pack_into(b, base, kind, 1, 1, n)
        b[base + _ONE_OFF: base + _ONE_OFF + n] = data
        b[fo: fo + row] = self._fresh
        c += 1
        rw.idx = 0 if c == self._n_chunks else c
        _acquire()
        _release()
        if b[self._parked] != self._no_parked:
            self._wake_parked()
        return True

    def _wake_parked(self) -> None:
        for r, parked in enumerate(self.ring.buf[self._parked]):
            if parked:
                self.readers[r].wake()

    def slot_bytes(self, sizes: list[int]) -> int:
        if len(sizes) == 1:
            return _ONE_OFF + sizes[0]
        return framing.layout(sizes)[1]

    def write(self, frames: list, sizes: list[int], nbytes: int, deadline: float | None) -> None:
        ring = self.ring
        span = self.rw.span_for(nbytes)
        start = self._reserve(span, deadline)
        base = ring.chunk_offset(start)
        buf = ring.buf
        if len(frames) == 1:
            framing.write_one(buf, base, span, frames[0])
        else:
            framing.write_head(buf, base, KIND_DATA, span, sizes)
            offsets, _ = framing.layout(sizes)
            buf[base + offsets[0]: base + offsets[0] + sizes[0]] = frames[0]
            for f, off in zip(frames[1:], offsets[1:]):
                copy_into(buf, self._base_addr, base + off, f)
        self.rw.commit(start, span)
        self._notify()

    def write_overflow(self, send: Callable[[], None], deadline: float | None) -> None:
        """Mark the next slot 'on the overflow socket', send there, then publish."""
        start = self._reserve(1, deadline)
        self.ring.write_slot(start, KIND_OVERFLOW, 1)
        send()
        self.rw.commit(start, 1)
        self._notify()

    def close(self) -> None:
        """Tell readers no more messages come, wake them, release the pipes."""
        self.ring.mark_closed()
        fence()
        for p in self.readers:
            p.wake()
        for p in (self.own, *self.readers):
            p.close()

    def _notify(self) -> None:
        fence()
        if self.ring.any_reader_parked():
            self._wake_parked()

    def _try_reserve(self, span: int) -> int | None:
        rw = self.rw
        start = rw.try_reserve(span)
        if rw.wrapped:  # readers parked at the old position can move on to chunk 0
            rw.wrapped = False
            self._notify()
        return start

    def _reserve(self, span: int, deadline: float | None) -> int:
        start = self._try_reserve(span)
        if start is not None:
            return start
        with self.waiters:
            t0 = _perf()
            start = spin(lambda: self._try_reserve(span), self.policy)
            return start if start is not None else self._park(span, deadline, t0)

    def _park(self, span: int, deadline: float | None, t0: float) -> int:
        ring, pol = self.ring, self.policy
        next_log = t0 + WAIT_LOG_INTERVAL_S
        while True:
            ring.set_writer_parked(1)
            fence()
            start = self._try_reserve(span)
            now = _perf()
            if start is not None:
                ring.set_writer_parked(0)
                pol.record(now - t0)
                return start
            if self.shutdown_requested:
                ring.set_writer_parked(0)
                raise QueueShutdown("enqueue interrupted: shutdown() was called on this queue")
            if deadline is not None and now >= deadline:
                ring.set_writer_parked(0)
                raise QueueTimeout(f"enqueue timed out after {now - t0:.3f}s waiting for a free slot: "
                                   f"{self._laggards(span)}")
            if now >= next_log:
                logger.warning("writer has waited %.0fs for a free slot: %s", now - t0, self._laggards(span))
                next_log = now + WAIT_LOG_INTERVAL_S
            left = next_log - now if deadline is None else min(deadline, next_log) - now
            self.own.wait(left)
            ring.set_writer_parked(0)

    def _laggards(self, span: int) -> str:
        ring = self.ring
        late = sorted({self.reader_ranks[r] for c in self.rw.blocking_chunks(span) for r in ring.unread_by(c)})
        return (f"local reader rank(s) {late} have not read (or still hold in-place views of) "
                f"earlier messages")


class ShmReader:
    """Local reader `r`: waits for its next slot and turns it back into an object."""

    def __init__(self, ring: ShmRingBuffer, r: int, spin_us: float | None, wake_dir: str) -> None:
        self.ring = ring
        self.rr = RingReader(ring, r, on_release=self._wake_writer_if_parked)
        path = os.path.join(wake_dir, f"wake-r{r}")
        self.own = WakePipe(path, waiter=True)
        self._self_waker = WakePipe(path, waiter=False)
        self.writer = WakePipe(os.path.join(wake_dir, "wake-w"), waiter=False)
        note_ring_processes(1 + ring.n_reader)
        self.policy = SpinPolicy(spin_us)
        self.shutdown_requested = False
        self.waiters = Waiters()
        self._holders: dict[int, type] = {}
        self._leases: dict[int, weakref.ref] = {}
        self._flag_offs = ring.flag_offs
        self._chunk_offs = ring.chunk_offs
        self._stride = ring.stride
        self._b = ring.buf
        self._me = 1 + r
        self._n_chunks = ring.n_chunks
        self._one_max = ring.stride - _ONE_OFF

    def get_one(self) -> Any:
        """The next message if it is a ready one-frame, one-chunk message; else EMPTY."""
        rr = self.rr
        c = rr.idx
        b = self._b
        fo = self._flag_offs[c]
        me = fo + self._me
        if b[fo] != 1 or b[me]:
            return EMPTY
        base = self._chunk_offs[c]
        kind, span, nframes, n = _ONE.unpack_from(b, base)
        if span != 1 or nframes != 1 or n > self._one_max or (kind and kind != KIND_BYTES):
            return EMPTY
        c += 1
        rr.idx = 0 if c == self._n_chunks else c
        try:
            if kind:
                return bytes(b[base + _ONE_OFF: base + _ONE_OFF + n])
            return _loads(b[base + _ONE_OFF: base + _ONE_OFF + n])
        finally:
            b[me] = 1
            _acquire()
            _release()
            if b[_WRITER_PARKED]:
                self.writer.wake()

    def wake(self) -> None:
        """Wake this process's parked thread (used by shutdown)."""
        self._self_waker.wake()

    def close(self) -> None:
        for p in (self.own, self._self_waker, self.writer):
            p.close()

    def next_slot(self, timeout: float | None, indefinite: bool) -> tuple[int, int, int]:
        got = self.rr.poll()
        if got is not None:
            return got
        return self._wait(timeout, indefinite)

    def wait_readable(self, timeout: float | None, indefinite: bool) -> None:
        """Block until the head at this reader's index is published (spin, then park)."""
        b = self._b
        fo = self._flag_offs[self.rr.idx]
        me = fo + self._me
        if b[fo] == 1 and not b[me]:
            return
        with self.waiters:
            self._wait_readable(b, fo, me, timeout, indefinite)

    def _wait_readable(self, b: memoryview, fo: int, me: int, timeout: float | None, indefinite: bool) -> None:
        pol = self.policy
        t0 = _perf()
        if pol.limit > 0:
            # The hot spin: two byte loads per check, the clock every 16 checks,
            # a yield of the core every waiting.yield_interval() (see there).
            end = t0 + pol.limit
            gap = waiting.yield_interval()
            next_yield = t0 + gap
            i = 0
            while True:
                if b[fo] == 1 and not b[me]:
                    pol.record(_perf() - t0)
                    return
                i += 1
                if i >= 16:
                    i = 0
                    now = _perf()
                    if now >= end:
                        break
                    if now >= next_yield:
                        sched_yield()
                        next_yield = now + gap
        self._park_counted(t0, timeout, indefinite)

    def _wait(self, timeout: float | None, indefinite: bool) -> tuple[int, int, int]:
        with self.waiters:
            return self._wait_counted(timeout, indefinite)

    def _wait_counted(self, timeout: float | None, indefinite: bool) -> tuple[int, int, int]:
        rr = self.rr
        t0 = _perf()
        got = spin(rr.poll, self.policy)
        while got is None:
            # Readable can mean a WRAP marker whose next message is not out yet: park again.
            left = None if timeout is None else max(0.0, timeout - (_perf() - t0))
            self._park_counted(_perf(), left, indefinite)
            got = rr.poll()
        return got

    def _park_counted(self, t0: float, timeout: float | None, indefinite: bool) -> None:
        rr, ring, pol = self.rr, self.ring, self.policy
        deadline = None if timeout is None else t0 + timeout
        next_log = t0 + WAIT_LOG_INTERVAL_S
        r = rr.r
        while True:
            ring.set_reader_parked(r, 1)
            fence()
            ready = ring.readable(rr.idx, r)
            now = _perf()
            if ready:
                ring.set_reader_parked(r, 0)
                pol.record(now - t0)
                return
            if self.shutdown_requested:
                ring.set_reader_parked(r, 0)
                raise QueueShutdown("dequeue interrupted: shutdown() was called on this queue")
            if ring.closed:
                ring.set_reader_parked(r, 0)
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            if deadline is not None and now >= deadline:
                ring.set_reader_parked(r, 0)
                raise QueueTimeout(f"dequeue timed out after {now - t0:.3f}s: no message from the writer")
            if now >= next_log:
                if not indefinite:
                    logger.info("reader %d has waited %.0fs for a message", r, now - t0)
                next_log = now + WAIT_LOG_INTERVAL_S
            if deadline is not None:
                self.own.wait(min(deadline, next_log) - now)
            else:
                self.own.wait(None if indefinite else next_log - now)
            ring.set_reader_parked(r, 0)

    def release(self, start: int, span: int) -> None:
        self.rr.release(start, span)  # then _wake_writer_if_parked

    def _wake_writer_if_parked(self) -> None:
        fence()
        if self.ring.writer_parked:
            self.writer.wake()

    def read(self, start: int, span: int) -> Any:
        """Unpickle the message in chunks start.. and free them (now, or when its views die)."""
        ring = self.ring
        buf = ring.buf
        base = ring.chunk_offset(start)
        limit = span * ring.stride
        n0 = framing.read_one_length(buf, base)
        if n0 >= 0:
            try:
                if _ONE_OFF + n0 > limit:
                    raise BadFrame(f"corrupt slot: a {n0}-byte frame in a {limit}-byte slot")
                if buf[base] == KIND_BYTES:
                    return bytes(buf[base + _ONE_OFF: base + _ONE_OFF + n0])
                return _loads(buf[base + _ONE_OFF: base + _ONE_OFF + n0])
            finally:
                self.release(start, span)
        try:
            offsets, lengths = framing.read_layout(buf, base, limit)
        except BadFrame:
            self.release(start, span)
            raise
        if max(lengths[1:]) < INPLACE_MIN_BYTES:
            try:
                bufs = [bytearray(buf[base + o: base + o + n]) for o, n in zip(offsets[1:], lengths[1:])]
                return _loads(buf[base + offsets[0]: base + offsets[0] + lengths[0]], buffers=bufs)
            finally:
                self.release(start, span)
        return self._read_in_place(start, span, base, offsets, lengths)

    def _read_in_place(self, start: int, span: int, base: int, offsets: list[int], lengths: list[int]) -> Any:
        # The payload views hang off one ctypes object per message; when the
        # last view dies, so does it, and its weakref callback frees the chunks.
        nbytes = span * self._stride
        htype = self._holders.get(nbytes)
        if htype is None:
            htype = self._holders[nbytes] = ctypes.c_char * nbytes
        holder = htype.from_buffer(self.ring._mm, base)
        key = id(holder)
        release = self.release
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
