"""`ShmRingBuffer`: the shared segment — N fixed chunks plus per-chunk flag bytes — and its lifetime.

Layout (all offsets from the start of the segment)::

    0     header: magic, version, n_reader, n_chunks, chunk stride, offsets, queue id
    64    u8  writer_parked   the writer waits for a free chunk (readers wake it)
    65    u8  closed          set by the writer on close
    128   u8  reader_parked[n_reader]
    F     flags[n_chunks][1 + n_reader]: written, then one byte per reader
    D     chunks[n_chunks], each `stride` bytes (page aligned)

What the flags mean, and who may touch them when, is the ring protocol
(ring.py); what a chunk holds is the slot layout (slots.py). This module
only makes, maps and removes the segment.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import struct

from ..errors import HandleError, SegmentNotFound, ShmSpaceError
from ..net import runtime_dir

try:  # CPython's own binding of shm_open/shm_unlink, without multiprocessing's resource tracker.
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = [
    "ShmRingBuffer",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_MAX_CHUNKS",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "WRITER_PARKED",
    "CLOSED",
    "READER_PARKED",
    "shm_free_bytes",
    "shm_open",
    "unlink_segment",
    "creator_pid",
    "creator_alive",
    "entries",
    "stale_entries",
    "remove_entries_of",
    "create_probe",
    "check_probe",
    "remove_probe",
]

#: A ring's default size, for every queue and relay: 24 chunks of 4 MiB (96 MiB of /dev/shm). A message may span
#: several consecutive chunks, so anything up to the whole ring stays in shared memory; only larger messages
#: take the overflow socket.
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_CHUNKS = 24
SEGMENT_PREFIX = "rayfree-"
SHM_DIR = "/dev/shm"

_MAGIC = b"RAYFREE\x01"
_VERSION = 1
_HEADER = struct.Struct("<8sIIIIQQQ16s")  # magic, version, n_reader, n_chunks, pad, stride, flags_off, data_off, qid
WRITER_PARKED = 64
CLOSED = 65
READER_PARKED = 128
_PAGE = mmap.PAGESIZE


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
        f"smaller max_chunk_bytes / max_chunks.",
    )


class ShmRingBuffer:
    """The shared segment and its flag protocol; no waiting, no serialization."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        magic, version, n_reader, n_chunks, _, stride, flags_off, data_off, qid = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise HandleError(f"shared-memory segment {name!r} is not a rayfree ring (bad magic)")
        if version != _VERSION:
            raise HandleError(
                f"ring {name!r} has layout version {version}, this rayfree reads {_VERSION}: "
                f"run the same rayfree version on every process"
            )
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
        #: bytes per chunk in the flag table: `written`, then one per reader
        self.row = 1 + n_reader
        #: Byte offset of each chunk's flag row and of each chunk (hot paths index these).
        self.flag_offs = [flags_off + c * self.row for c in range(n_chunks)]
        self.chunk_offs = [data_off + c * stride for c in range(n_chunks)]
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
        stride = _align(max_chunk_bytes, _PAGE)
        flags_off = _align(READER_PARKED + n_reader, 64)
        data_off = _align(flags_off + max_chunks * (1 + n_reader), _PAGE)
        size = data_off + max_chunks * stride
        free = shm_free_bytes()
        if free is not None and free < size:
            raise _space_error(size, free, max_chunks, stride)
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
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
            unlink_segment(name)
            raise
        _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, n_reader, max_chunks, 0, stride, flags_off, data_off, queue_id)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int, queue_id: str) -> ShmRingBuffer:
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise HandleError(f"handle names shared-memory segment {name!r}, which is not a rayfree segment")
        try:
            fd = shm_open(name, os.O_RDWR)
        except FileNotFoundError:
            raise SegmentNotFound(
                errno.ENOENT,
                f"shared-memory segment {name!r} does not exist here: this reader is on another node "
                f"than the writer (attach it as a remote reader), or the writer has already unlinked "
                f"it (all local readers must attach before the writer's wait_until_ready() returns)",
            ) from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise HandleError(
                    f"segment {name!r} is {actual} bytes but the handle says {size}: "
                    f"the handle does not belong to this segment"
                )
            mm = _map(fd, size)
        finally:
            os.close(fd)
        ring = cls(name, mm, owner=False)
        if ring.queue_id != queue_id:
            ring.close()
            raise HandleError(
                f"segment {name!r} belongs to queue {ring.queue_id}, the handle to "
                f"{queue_id}: a stale or mismatched handle"
            )
        return ring

    def chunk_offset(self, c: int) -> int:
        return self.data_off + c * self.stride

    # -- lifetime ----------------------------------------------------------

    def unlink(self) -> None:
        """Remove the name from /dev/shm; mappings stay valid until closed."""
        if not self._unlinked:
            self._unlinked = True
            unlink_segment(self.name)

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


def shm_open(name: str, flags: int, mode: int = 0) -> int:
    """A descriptor of POSIX shared-memory segment `name` (no resource tracker involved)."""
    if _posixshmem is None:  # pragma: no cover - non-POSIX
        raise OSError("POSIX shared memory is not available on this platform")
    return _posixshmem.shm_open("/" + name, flags, mode=mode)


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def unlink_segment(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


# -- segments -----------------------------------------------------------------------------------------
# rayfree's names in /dev/shm and the runtime directory, and which of them a dead process left behind.
#
# Every segment and ipc directory rayfree makes is named `rayfree-<creator pid>-...`,
# so `rayfree doctor`, the demo and the tests can tell a live queue's from a leak.
def creator_pid(name: str) -> int | None:
    """The pid in a `rayfree-<pid>-...` name (None: not a name rayfree makes)."""
    base = os.path.basename(name)
    if not base.startswith(SEGMENT_PREFIX):
        return None
    try:
        return int(base[len(SEGMENT_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return None


def creator_alive(name: str) -> bool:
    """Is the process that made `name` still running? (True when it cannot be told.)"""
    pid = creator_pid(name)
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def entries(dirs: tuple[str, ...] | None = None) -> set[str]:
    """Paths of every rayfree segment and ipc directory in `dirs` (default: /dev/shm and the runtime dir)."""
    out: set[str] = set()
    for d in dirs or (SHM_DIR, runtime_dir()):
        try:
            out |= {os.path.join(d, n) for n in os.listdir(d) if n.startswith(SEGMENT_PREFIX)}
        except OSError:
            pass
    return out


def stale_entries(dirs: tuple[str, ...] | None = None) -> list[str]:
    """The entries whose creating process is gone."""
    return sorted(p for p in entries(dirs) if creator_pid(p) is not None and not creator_alive(p))


def remove_entries_of(pids: set[int], dirs: tuple[str, ...] | None = None) -> list[str]:
    """Remove every rayfree segment and ipc directory made by one of `pids` (a process that is gone, or is
    about to go); returns what it removed."""
    import shutil

    removed = []
    for path in sorted(entries(dirs)):
        if creator_pid(path) in pids:
            try:
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
    return removed


# -- shm_probe ----------------------------------------------------------------------------------------
# Same node means "can open the same shared-memory segment": a probe, not a hostname guess.
#
# The source creates a tiny segment holding a random token; every other
# process tries to open it and compare the token. Two network namespaces that
# share /dev/shm are honestly one node; two containers with private /dev/shm
# are two, whatever their hostnames say.
_TOKEN_BYTES = 16


def create_probe() -> tuple[str, bytes]:
    """Make a probe segment; returns (name, token). Remove it with `remove_probe`."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}-probe-{secrets.token_hex(6)}"
    token = secrets.token_bytes(_TOKEN_BYTES)
    fd = shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, _TOKEN_BYTES)
        with mmap.mmap(fd, _TOKEN_BYTES) as m:
            m[:] = token
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)
    return name, token


def check_probe(name: str, token: bytes) -> bool:
    """True if this process sees the probe segment `name` holding `token`."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name:
        return False
    try:
        fd = shm_open(name, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != _TOKEN_BYTES:
            return False
        with mmap.mmap(fd, _TOKEN_BYTES, prot=mmap.PROT_READ) as m:
            return m[:] == token
    finally:
        os.close(fd)


def remove_probe(name: str) -> None:
    unlink_segment(name)
