"""The ring's publish/consume protocol: the only code that reads or writes its flag bytes.

Each chunk has a flag row: `written`, then one byte per reader (0 unread,
HELD taken and not yet released, 1 released). A message occupies `span`
consecutive chunks from its head chunk. The writer may reuse a chunk when it
was never written or every reader's byte there is 1; it publishes a message by
resetting the reader bytes of its span (head last). Reader `r` may take the
head at its index when `written` is set and its own byte is 0; it releases a
span by setting its byte to 1 in every chunk of it. A message that would run
past the last chunk is preceded by a one-chunk WRAP marker, so a span is
always contiguous memory.

Ordering. Python stores to a shared mapping are plain machine stores, in
program order as far as the compiler goes (each is its own call into the
interpreter). Two kinds of fence (a lock's acquire + release, as vLLM's
queue uses) keep the hardware in line:
- the *ordering* fences: between the payload and the flags on the writer,
  between the flags and the payload on the reader. aarch64 (Grace, Graviton)
  reorders stores with stores and loads with loads, so they are needed
  there; x86 (TSO) never does, so there they are skipped unless
  RAYFREE_RING_FENCES=always (bench/transport.py measures what they would cost);
- the *store->load* fences, between a flag store and the load of the other
  side's `parked` byte (the wake-up protocol, see waiting.py): x86 reorders
  a store with a later load too, so these run on every CPU.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from rayfree import settings

from ..channel import EMPTY
from ..errors import BadFrame
from .segment import CLOSED, READER_PARKED, WRITER_PARKED, ShmRingBuffer
from .slots import KIND_DATA, KIND_WRAP, KINDS, ONE, ONE_FRAME_OFFSET, SLOT
from .waiting import SpinPolicy, _fence_acquire, _fence_release, fence, sched_yield

# fence() inlined as its two calls on the hot paths (a Python frame costs as much as the fence itself).
_acquire, _release = _fence_acquire, _fence_release
_perf = time.perf_counter
#: CPUs that keep stores in order and loads in order (TSO)
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")


def ordering_fences() -> bool:
    """Does this CPU need the payload<->flags fences (RAYFREE_RING_FENCES: auto, or always)?"""
    mode = settings.get("RAYFREE_RING_FENCES")
    if mode not in ("auto", "always"):
        raise ValueError(f"RAYFREE_RING_FENCES={mode!r}: use auto (fences where the CPU reorders) or always")
    return mode == "always" or not _TSO


__all__ = ["RingWriter", "RingReader", "HELD", "EMPTY"]

#: A reader's flag byte while it holds a message it took (0 unread, 1 released).
HELD = 2


class RingWriter:
    """The writer's side: where the next message goes, and publishing it."""

    def __init__(self, ring: ShmRingBuffer) -> None:
        n = ring.n_reader
        self.ring = ring
        self.idx = 0
        self.wrapped = False  # a WRAP marker was published since the owner last looked
        self._order = ordering_fences()
        #: the longest one-frame message `put_one` takes
        self.one_max = ring.stride - ONE_FRAME_OFFSET
        self._b = ring.buf
        self._row = ring.row
        self._n_chunks = ring.n_chunks
        self._flag_offs = ring.flag_offs
        self._chunk_offs = ring.chunk_offs
        self._single = n == 1
        self._fresh = b"\x01" + b"\x00" * n
        self._all_read = b"\x01" * n
        self._no_parked = b"\x00" * n
        self._parked = slice(READER_PARKED, READER_PARKED + n)

    def chunk_free(self, c: int) -> bool:
        fo = self._flag_offs[c]
        b = self._b
        return b[fo] == 0 or b[fo + 1 : fo + self._row] == self._all_read

    def holders(self, c: int) -> list[int]:
        """Reader indices that still hold chunk `c` (unread, or taken and not released)."""
        fo = self._flag_offs[c]
        b = self._b
        return [] if b[fo] == 0 else [r for r in range(self.ring.n_reader) if b[fo + 1 + r] != 1]

    def put_one(self, data: bytes) -> int:
        """Publish `data` as a one-frame, one-chunk message if the next chunk is free: the hot path of every
        small message, the only code that writes one. 0: not written (the chunk is held, or `data` is too long:
        use try_reserve/commit); 1: published; 2: published, and some reader is parked (wake it).

        With one reader (every reply queue) its flag and parked bytes are read and written as bytes, not
        slices: the three places marked `single` are the only difference."""
        c = self.idx
        b = self._b
        fo = self._flag_offs[c]
        n = len(data)
        single = self._single
        if n > self.one_max or (b[fo] and (b[fo + 1] != 1 if single else b[fo + 1 : fo + self._row] != self._all_read)):
            return 0
        base = self._chunk_offs[c]
        ONE.pack_into(b, base, KIND_DATA, 1, 1, n)
        b[base + ONE_FRAME_OFFSET : base + ONE_FRAME_OFFSET + n] = data
        if self._order:  # fence: the payload before the flags
            _acquire()
            _release()
        if single:
            b[fo + 1] = 0
            b[fo] = 1
        else:
            b[fo : fo + self._row] = self._fresh
        c += 1
        self.idx = 0 if c == self._n_chunks else c
        _acquire()  # fence: the flags before the look at the parked bytes
        _release()
        if single:
            return 2 if b[READER_PARKED] else 1
        return 2 if b[self._parked] != self._no_parked else 1

    def span_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.ring.stride))

    def try_reserve(self, span: int) -> int | None:
        """Start chunk of a free run of `span` chunks, or None if readers still hold one.

        Publishes a WRAP marker first when the run would pass the ring's end.
        """
        pos = self.idx
        if pos + span > self._n_chunks:
            if not self.chunk_free(pos):
                return None
            SLOT.pack_into(self._b, self._chunk_offs[pos], KIND_WRAP, 1)
            self._publish(pos, 1)
            self.idx = pos = 0
            self.wrapped = True
        for c in range(pos, pos + span):
            if not self.chunk_free(c):
                return None
        return pos

    def blocking_chunks(self, span: int) -> list[int]:
        """The chunks the next reservation of `span` waits for."""
        pos = self.idx if self.idx + span <= self._n_chunks else 0
        return [c for c in range(pos, pos + span) if not self.chunk_free(c)]

    def commit(self, start: int, span: int) -> None:
        """Publish the message the caller wrote into chunks start..start+span-1."""
        self._publish(start, span)
        self.idx = (start + span) % self._n_chunks

    def _publish(self, start: int, span: int) -> None:
        b, fo0, row, fresh = self._b, self._flag_offs, self._row, self._fresh
        if self._order:
            fence()  # the payload before the flags
        for c in range(start + span - 1, start - 1, -1):  # the head last
            fo = fo0[c]
            b[fo : fo + row] = fresh
        fence()  # the flags before the caller's look at the parked bytes

    # -- the parked bytes (waiting.py's protocol) and closing -----------------------------------

    def readers_parked(self) -> bool:
        if self._single:
            return self._b[READER_PARKED] != 0
        return self._b[self._parked] != self._no_parked

    def parked_readers(self) -> list[int]:
        return [r for r, v in enumerate(self._b[self._parked]) if v]

    def set_parked(self, v: int) -> None:
        self._b[WRITER_PARKED] = v
        if v:
            fence()  # parked before the caller's re-check of the flags

    def mark_closed(self) -> None:
        self._b[CLOSED] = 1
        fence()


class RingReader:
    """Reader `r`'s side: its index, taking the head there, releasing what it took.

    `on_writer_parked` runs after a release that finds the writer parked (the
    channel wakes it), including the WRAP markers `poll` consumes.
    """

    def __init__(
        self,
        ring: ShmRingBuffer,
        r: int,
        loads: Callable[[Any], Any],
        on_writer_parked: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= r < ring.n_reader:
            raise ValueError(f"reader index {r} out of range 0..{ring.n_reader - 1}")
        self.ring = ring
        self.r = r
        self.idx = 0
        self.loads = loads
        self.on_writer_parked = on_writer_parked or (lambda: None)
        self._order = ordering_fences()
        self.one_max = ring.stride - ONE_FRAME_OFFSET
        self._b = ring.buf
        self._row = ring.row
        self._me = 1 + r
        self._n_chunks = ring.n_chunks
        self._flag_offs = ring.flag_offs
        self._chunk_offs = ring.chunk_offs

    def ready(self) -> bool:
        """Is the head at this reader's index published for it? (A WRAP marker counts.)"""
        fo = self._flag_offs[self.idx]
        b = self._b
        return b[fo] == 1 and not b[fo + self._me]

    def spin_ready(self, policy: SpinPolicy, limit: float | None = None, since: float | None = None) -> bool:
        """The hot spin of a waiting reader: until the head is published for it (True) or the policy's limit
        (or `limit` seconds) passes (False); the wait recorded counts from `since` (default: now). Two byte
        loads per check, the clock every 16 checks, the core yielded now and then."""
        if limit is None:
            limit = policy.limit
        if limit <= 0:
            return False
        b = self._b
        fo = self._flag_offs[self.idx]
        me = fo + self._me
        t0 = _perf()
        end = t0 + limit
        if since is None:
            since = t0
        gap = policy.yield_s
        next_yield = t0 + gap
        i = 0
        while True:
            if b[fo] == 1 and not b[me]:
                policy.record(_perf() - since)
                return True
            i += 1
            if i >= 16:
                i = 0
                now = _perf()
                if now >= end:
                    return False
                if now >= next_yield:
                    sched_yield()
                    next_yield = now + gap

    def get_one(self) -> Any:
        """The next message, decoded and released, if it is a ready one-frame, one-chunk one; else EMPTY."""
        c = self.idx
        b = self._b
        fo = self._flag_offs[c]
        me = fo + self._me
        if b[fo] != 1 or b[me]:
            return EMPTY
        if self._order:  # fence: the flags before the payload
            _acquire()
            _release()
        base = self._chunk_offs[c]
        kind, span, nframes, n = ONE.unpack_from(b, base)
        if span != 1 or nframes != 1 or n > self.one_max or kind != KIND_DATA:
            return EMPTY
        c += 1
        self.idx = 0 if c == self._n_chunks else c
        try:
            if b[base + ONE_FRAME_OFFSET] == 1:  # serde's RAW: a small bytes message as it is
                return bytes(b[base + ONE_FRAME_OFFSET + 1 : base + ONE_FRAME_OFFSET + n])
            return self.loads(b[base + ONE_FRAME_OFFSET : base + ONE_FRAME_OFFSET + n])
        finally:
            b[me] = 1
            _acquire()  # fence: the release before the look at the writer's parked byte
            _release()
            if b[WRITER_PARKED]:
                self.on_writer_parked()

    def poll(self) -> tuple[int, int, int] | None:
        """Take the next message: (start, kind, span), or None; skips WRAP markers. Release it when done."""
        while self.ready():
            if self._order:
                fence()  # the flags before the payload
            c = self.idx
            kind, span = SLOT.unpack_from(self._b, self._chunk_offs[c])
            if kind == KIND_WRAP:
                self.release(c, 1)
                self.idx = 0
                continue
            if kind not in KINDS or not 1 <= span <= self._n_chunks - c:
                self.release(c, 1)
                self.idx = (c + 1) % self._n_chunks
                raise BadFrame(
                    f"ring {self.ring.name!r} chunk {c}: corrupt slot header "
                    f"(kind={kind}, span={span}); message skipped"
                )
            self.idx = (c + span) % self._n_chunks
            self._b[self._flag_offs[c] + self._me] = HELD
            return c, kind, span
        return None

    def release(self, start: int, span: int) -> None:
        b, fo0, me = self._b, self._flag_offs, self._me
        for c in range(start, start + span):
            b[fo0[c] + me] = 1
        fence()  # the release before the look at the writer's parked byte
        if b[WRITER_PARKED]:
            self.on_writer_parked()

    # -- the parked byte (waiting.py's protocol) and closing -------------------------------------

    def set_parked(self, v: int) -> None:
        self._b[READER_PARKED + self.r] = v
        if v:
            fence()  # parked before the caller's re-check of the flags

    @property
    def closed(self) -> bool:
        return self._b[CLOSED] == 1
