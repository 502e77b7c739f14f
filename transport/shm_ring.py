"""`ShmRingBuffer`: N fixed chunks plus per-chunk flag bytes in one POSIX segment.

Layout (all offsets from the start of the segment)::

    0     header: magic, version, n_reader, n_chunks, chunk stride, offsets, queue id
    64    u8  writer_parked   the writer waits for a free chunk (readers wake it)
    65    u8  closed          set by the writer on close
    128   u8  reader_parked[n_reader]
    F     flags[n_chunks][1 + n_reader]: written, read-by-reader-0, read-by-reader-1, ...
    D     chunks[n_chunks], each `stride` bytes (page aligned)

A message occupies `span` consecutive chunks starting at a *head* chunk whose
first bytes say its kind and span. A chunk is free for the writer when it was
never written or every reader has released it. The writer publishes by
resetting the reader flags of the span (head last); reader `r` may read the
head at its index when `written` is set and its own flag is 0. Taking a
message sets the reader's flag in the head to 2 (read, still held: its index
may come round to that chunk again before it lets go); freeing the span sets
its flag to 1 in every chunk of it. The writer reuses a chunk only when every
reader's flag there is 1. A message that would
run past the last chunk is preceded by a one-chunk WRAP marker, so a span is
always contiguous memory and big payloads can be used in place.

Python stores to distinct bytes of a shared mapping are single `mov`s; on
x86 (TSO) stores stay ordered with stores and loads with loads, which is all
the publish/consume protocol needs. The one store->load ordering (parked flag
vs. data check) goes through `waiting.fence()`; see waiting.py for parking.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import struct
from typing import Callable

from .errors import BadFrame, HandleError, SegmentNotFound, ShmSpaceError

try:  # CPython's own binding of shm_open/shm_unlink, without multiprocessing's resource tracker.
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = ["ShmRingBuffer", "RingReader", "RingWriter", "KIND_DATA", "KIND_OVERFLOW", "KIND_WRAP", "KIND_BYTES",
           "SEGMENT_PREFIX", "SHM_DIR"]

SEGMENT_PREFIX = "rayfree-"
SHM_DIR = "/dev/shm"

_MAGIC = b"RAYFREE\x01"
_VERSION = 1
_HEADER = struct.Struct("<8sIIIIQQQ16s")  # magic, version, n_reader, n_chunks, pad, stride, flags_off, data_off, qid
_WRITER_PARKED = 64
_CLOSED = 65
_READER_PARKED = 128
_PAGE = mmap.PAGESIZE

# Head chunk of every message: u8 kind, 3 pad bytes, u32 span. The rest of the
# head chunk belongs to the framing (see framing.py).
KIND_DATA = 0      # frames: a pickle stream and its out-of-band buffers
KIND_OVERFLOW = 1  # the frames travel on the overflow socket
KIND_WRAP = 2      # nothing here: continue at chunk 0
KIND_BYTES = 3     # one frame of raw bytes, delivered as `bytes` without pickle
# A reader's flag byte: 0 unread, HELD taken but not yet released, 1 released.
HELD = 2
_SLOT = struct.Struct("<BxxxI")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where there is no such mount."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _space_error(need: int, free: int | None, n_chunks: int, stride: int) -> ShmSpaceError:
    have = "an unknown amount" if free is None else _mib(free)
    return ShmSpaceError(
        errno.ENOSPC,
        f"not enough shared memory: this queue needs {_mib(need)} in {SHM_DIR} "
        f"({n_chunks} chunks x {_mib(stride)}) but {have} is free. Give the process more "
        f"shared memory (docker: `--shm-size=2g` or `--ipc=host`; compose: `shm_size: 2gb` or "
        f"`ipc: host`), remove stale `{SEGMENT_PREFIX}*` segments (`rayfree doctor`), or pass a "
        f"smaller max_chunk_bytes / max_chunks.")


class ShmRingBuffer:
    """The shared segment and its flag protocol; no waiting, no serialization."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        magic, version, n_reader, n_chunks, _, stride, flags_off, data_off, qid = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise HandleError(f"shared-memory segment {name!r} is not a rayfree ring (bad magic)")
        if version != _VERSION:
            raise HandleError(f"ring {name!r} has layout version {version}, this rayfree reads {_VERSION}: "
                              f"run the same rayfree version on every process")
        self.name = name
        self.owner = owner
        self.n_reader = n_reader
        self.n_chunks = n_chunks
        self.stride = stride
        self.flags_off = flags_off
        self.data_off = data_off
        self.queue_id = qid.hex()
        self.size = len(mm)
        self.capacity = n_chunks * stride
        self._mm = mm
        self.buf = memoryview(mm)
        self._row = 1 + n_reader
        #: Byte offset of each chunk's flag row and of each chunk (hot paths index these).
        self.flag_offs = [flags_off + c * self._row for c in range(n_chunks)]
        self.chunk_offs = [data_off + c * stride for c in range(n_chunks)]
        self._fresh = b"\x01" + b"\x00" * n_reader
        self._all_read = b"\x01" * n_reader
        self._no_parked = b"\x00" * n_reader
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping; gives its address
        self.address = ctypes.addressof(self._anchor)
        self._unlinked = not owner

    # -- creation ----------------------------------------------------------

    @classmethod
    def create(cls, n_reader: int, max_chunk_bytes: int, max_chunks: int, queue_id: bytes) -> ShmRingBuffer:
        if n_reader < 1:
            raise ValueError(f"a ring needs at least one local reader, got n_reader={n_reader}")
        if max_chunks < 2:
            raise ValueError(f"max_chunks must be >= 2, got {max_chunks}")
        if max_chunk_bytes < 1024:
            raise ValueError(f"max_chunk_bytes must be >= 1024, got {max_chunk_bytes}")
        if _posixshmem is None:  # pragma: no cover
            raise OSError("POSIX shared memory is not available on this platform")
        stride = _align(max_chunk_bytes, _PAGE)
        flags_off = _align(_READER_PARKED + n_reader, 64)
        data_off = _align(flags_off + max_chunks * (1 + n_reader), _PAGE)
        size = data_off + max_chunks * stride
        free = shm_free_bytes()
        if free is not None and free < size:
            raise _space_error(size, free, max_chunks, stride)
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: a full tmpfs then fails here with a clear
                # error instead of killing a process with SIGBUS mid-message.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise _space_error(size, shm_free_bytes(), max_chunks, stride) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                mm = _map(fd, size)
            finally:
                os.close(fd)
        except BaseException:
            _unlink(name)
            raise
        _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, n_reader, max_chunks, 0, stride, flags_off, data_off,
                          queue_id)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int, queue_id: str) -> ShmRingBuffer:
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise HandleError(f"handle names shared-memory segment {name!r}, which is not a rayfree segment")
        if _posixshmem is None:  # pragma: no cover
            raise OSError("POSIX shared memory is not available on this platform")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0)
        except FileNotFoundError:
            raise SegmentNotFound(
                errno.ENOENT,
                f"shared-memory segment {name!r} does not exist here: this reader is on another node "
                f"than the writer (attach it as a remote reader), or the writer has already unlinked "
                f"it (all local readers must attach before the writer's wait_until_ready() returns)") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise HandleError(f"segment {name!r} is {actual} bytes but the handle says {size}: "
                                  f"the handle does not belong to this segment")
            mm = _map(fd, size)
        finally:
            os.close(fd)
        ring = cls(name, mm, owner=False)
        if ring.queue_id != queue_id:
            ring.close()
            raise HandleError(f"segment {name!r} belongs to queue {ring.queue_id}, the handle to "
                              f"{queue_id}: a stale or mismatched handle")
        return ring

    # -- flags -------------------------------------------------------------

    def chunk_offset(self, c: int) -> int:
        return self.data_off + c * self.stride

    def chunk_free(self, c: int) -> bool:
        fo = self.flags_off + c * self._row
        b = self.buf
        return b[fo] == 0 or b[fo + 1: fo + self._row] == self._all_read

    def unread_by(self, c: int) -> list[int]:
        """Reader indices that still hold chunk `c` (unread, or read and not released)."""
        fo = self.flags_off + c * self._row
        b = self.buf
        if b[fo] == 0:
            return []
        return [r for r in range(self.n_reader) if b[fo + 1 + r] != 1]

    def publish(self, start: int, span: int) -> None:
        """Hand chunks start..start+span-1 to every reader; the head goes last."""
        b, row, fo0, fresh = self.buf, self._row, self.flags_off, self._fresh
        for c in range(start + span - 1, start - 1, -1):
            fo = fo0 + c * row
            b[fo: fo + row] = fresh

    def readable(self, c: int, r: int) -> bool:
        fo = self.flags_off + c * self._row
        b = self.buf
        return b[fo] == 1 and b[fo + 1 + r] == 0

    def release(self, start: int, span: int, r: int) -> None:
        b, row = self.buf, self._row
        fo = self.flags_off + start * row + 1 + r
        for _ in range(span):
            b[fo] = 1
            fo += row

    def slot(self, c: int) -> tuple[int, int]:
        """(kind, span) written in head chunk `c`."""
        return _SLOT.unpack_from(self.buf, self.data_off + c * self.stride)

    def write_slot(self, c: int, kind: int, span: int) -> None:
        _SLOT.pack_into(self.buf, self.data_off + c * self.stride, kind, span)

    # -- parking flags -----------------------------------------------------

    def set_reader_parked(self, r: int, v: int) -> None:
        self.buf[_READER_PARKED + r] = v

    def any_reader_parked(self) -> bool:
        return self.buf[_READER_PARKED: _READER_PARKED + self.n_reader] != self._no_parked

    def set_writer_parked(self, v: int) -> None:
        self.buf[_WRITER_PARKED] = v

    @property
    def writer_parked(self) -> bool:
        return self.buf[_WRITER_PARKED] == 1

    def mark_closed(self) -> None:
        self.buf[_CLOSED] = 1

    @property
    def closed(self) -> bool:
        return self.buf[_CLOSED] == 1

    # -- lifetime ----------------------------------------------------------

    def unlink(self) -> None:
        """Remove the name from /dev/shm; mappings stay valid until closed."""
        if not self._unlinked:
            self._unlinked = True
            _unlink(self.name)

    def close(self) -> None:
        """Unmap (once no payload view of a chunk is alive) and unlink if we own it."""
        if self.owner:
            self.unlink()
        if self._mm.closed:
            return
        self.buf.release()
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:
            # A reader still holds a payload view into a chunk; the mapping
            # goes away with the last view.
            pass


class RingWriter:
    """The writer's side of the protocol: where the next message goes."""

    def __init__(self, ring: ShmRingBuffer) -> None:
        self.ring = ring
        self.idx = 0
        self.wrapped = False  # a WRAP marker was published since the owner last looked

    def span_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.ring.stride))

    def try_reserve(self, span: int) -> int | None:
        """Start chunk of a free run of `span` chunks, or None if readers still hold one.

        Emits a WRAP marker first when the run would pass the ring's end.
        """
        ring = self.ring
        pos = self.idx
        if pos + span > ring.n_chunks:
            if not ring.chunk_free(pos):
                return None
            ring.write_slot(pos, KIND_WRAP, 1)
            ring.publish(pos, 1)
            self.idx = pos = 0
            self.wrapped = True
        for c in range(pos, pos + span):
            if not ring.chunk_free(c):
                return None
        return pos

    def blocking_chunks(self, span: int) -> list[int]:
        """The chunks the next reservation of `span` waits for."""
        ring = self.ring
        pos = self.idx if self.idx + span <= ring.n_chunks else 0
        return [c for c in range(pos, pos + span) if not ring.chunk_free(c)]

    def commit(self, start: int, span: int) -> None:
        self.ring.publish(start, span)
        self.idx = (start + span) % self.ring.n_chunks


class RingReader:
    """Reader `r`'s side of the protocol: its index and the head it may read.

    `on_release` runs after every release (the channel wakes a writer that
    waits for space there), including the WRAP markers `poll` consumes.
    """

    def __init__(self, ring: ShmRingBuffer, r: int, on_release: Callable[[], None] | None = None) -> None:
        if not 0 <= r < ring.n_reader:
            raise ValueError(f"reader index {r} out of range 0..{ring.n_reader - 1}")
        self.ring = ring
        self.r = r
        self.idx = 0
        self.on_release = on_release

    def poll(self) -> tuple[int, int, int] | None:
        """(start, kind, span) of the next message, or None; skips WRAP markers."""
        ring, r = self.ring, self.r
        while ring.readable(self.idx, r):
            c = self.idx
            kind, span = ring.slot(c)
            if kind == KIND_WRAP:
                self.release(c, 1)
                self.idx = 0
                continue
            if kind not in (KIND_DATA, KIND_OVERFLOW, KIND_BYTES) or not 1 <= span <= ring.n_chunks - c:
                self.release(c, 1)
                self.idx = (c + 1) % ring.n_chunks
                raise BadFrame(f"ring {ring.name!r} chunk {c}: corrupt slot header "
                               f"(kind={kind}, span={span}); message skipped")
            self.idx = (c + span) % ring.n_chunks
            ring.buf[ring.flags_off + c * ring._row + 1 + r] = HELD
            return c, kind, span
        return None

    def release(self, start: int, span: int) -> None:
        self.ring.release(start, span, self.r)
        if self.on_release is not None:
            self.on_release()


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
