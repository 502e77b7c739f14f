"""Copy a big payload into shared memory with several cores.

One core's copy of a big payload costs far more than everything else on the
path (docs/benchmarks.md, "Measurements behind the design"). `ctypes.memmove`
releases the GIL, so a few helper threads each copying a slice scale with
memory bandwidth.
Knob: RAYFREE_COPY_THREADS (default: min(4, cores); 1 disables), read at the first big copy.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import weakref
from collections import deque

from rayfree import settings
from rayfree.supervisor import supervisor

__all__ = ["copy_into", "PARALLEL_MIN_BYTES", "BufferPool", "size_class"]

#: Copies smaller than this run on the calling thread.
PARALLEL_MIN_BYTES = 4 << 20

_memmove = ctypes.memmove
_jobs: queue.SimpleQueue | None = None
_threads = 1
_pool_lock = threading.Lock()
_pool_pid = -1


def _worker(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get().run()


class _Copy:
    """One copy cut into slices that the caller and the helpers take in turn.

    The caller starts at once and never waits for a helper that has not
    started: a helper wakes late on a virtual machine, which on a copy of
    milliseconds is worth not waiting for.
    """

    __slots__ = ("dst", "src", "n", "step", "slices", "next", "done", "lock", "finished")

    def __init__(self, dst: int, src: int, n: int, slices: int) -> None:
        self.dst, self.src, self.n = dst, src, n
        self.step = (n // slices + 4095) & ~4095
        self.slices = -(-n // self.step)
        self.next = 0
        self.done = 0
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def run(self) -> None:
        while True:
            with self.lock:
                i = self.next
                if i >= self.slices:
                    return
                self.next = i + 1
            off = i * self.step
            _memmove(self.dst + off, self.src + off, min(self.step, self.n - off))
            with self.lock:
                self.done += 1
                if self.done == self.slices:
                    self.finished.set()


def _pool() -> tuple[queue.SimpleQueue, int]:
    """The helper threads' job queue and how many threads copy (RAYFREE_COPY_THREADS, read at first use)."""
    global _jobs, _pool_pid, _threads
    if _jobs is None or _pool_pid != os.getpid():
        with _pool_lock:
            if _jobs is None or _pool_pid != os.getpid():
                _threads = max(1, settings.get("RAYFREE_COPY_THREADS"))
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                for i in range(_threads - 1):
                    supervisor().start(f"RayfreeCopy-{i}", _worker, args=(jobs,))
                _jobs, _pool_pid = jobs, os.getpid()
    return _jobs, _threads


def _address(buf: memoryview) -> int | None:
    """Address of a writable contiguous buffer; None if it is read-only."""
    try:
        c = ctypes.c_char.from_buffer(buf)
    except TypeError:
        return None
    addr = ctypes.addressof(c)
    del c
    return addr


def copy_into(dst: memoryview, dst_addr: int, off: int, src: memoryview) -> None:
    """dst[off:off+len(src)] = src, split over the copy threads when it is big.

    `dst_addr` is the address of dst[0] (the caller owns that mapping).
    """
    n = src.nbytes
    if n < PARALLEL_MIN_BYTES:
        dst[off : off + n] = src
        return
    jobs, threads = _pool()
    src_addr = _address(src) if threads > 1 else None
    if src_addr is None:
        dst[off : off + n] = src
        return
    job = _Copy(dst_addr + off, src_addr, n, 4 * threads)
    for _ in range(threads - 1):
        jobs.put(job)
    job.run()
    job.finished.wait()


# -- pool ---------------------------------------------------------------------------------------------
# A reader's pool of warm buffers for the private copies of big payloads.
#
# Every reader gets its own writable copy of every tensor it receives (vLLM's
# semantics: a TP rank that changes its input in place must not change its
# peers'), so the ring's chunks are free the moment a message is read, however
# long the caller keeps the tensor. Copying into fresh memory is mostly page
# faults (several times the copy into memory used before: docs/benchmarks.md).
# So a buffer goes back to this pool
# when the caller has dropped the last tensor or view built on it (a weakref
# on the ctypes object the views hang from), and the next message of that size
# class gets it warm. What the caller keeps is never handed out again; the pool
# holds at most `limit` bytes of idle buffers.
_MIB = 1 << 20


def size_class(n: int) -> int:
    """Capacity of the buffer used for `n` bytes: the next MiB (payloads of one shape share a class)."""
    return (n + _MIB - 1) & ~(_MIB - 1)


class BufferPool:
    """Idle buffers by size class; `take(n)` gives a writable view of `n` bytes and its address."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle_bytes = 0
        self.hits = 0
        self.misses = 0
        self._free: dict[int, deque[bytearray]] = {}
        self._lock = threading.Lock()
        self._types: dict[int, type] = {}
        self._leases: dict[int, weakref.ref] = {}

    def take(self, n: int) -> tuple[memoryview, int]:
        """A writable view of `n` bytes (from an idle buffer if one fits, else a new one) and its address.

        The buffer returns to the pool when the view and everything made from it are gone.
        """
        cap = size_class(n)
        with self._lock:
            q = self._free.get(cap)
            base = q.pop() if q else None
            if base is not None:
                self.idle_bytes -= cap
                self.hits += 1
            else:
                self.misses += 1
        if base is None:
            base = bytearray(cap)
        htype = self._types.get(cap)
        if htype is None:
            htype = self._types[cap] = ctypes.c_char * cap
        holder = htype.from_buffer(base)
        key = id(holder)
        leases = self._leases
        give_back = self._give_back

        def _done(_ref, base=base, key=key, cap=cap):
            leases.pop(key, None)
            give_back(base, cap)

        leases[key] = weakref.ref(holder, _done)
        view = memoryview(holder).cast("B")[:n]
        addr = ctypes.addressof(holder)
        del holder  # the views keep it alive; when they die, the buffer comes back
        return view, addr

    def _give_back(self, base: bytearray, cap: int) -> None:
        with self._lock:
            if self.idle_bytes + cap > self.limit:
                return  # over the limit: let it go to the allocator
            self._free.setdefault(cap, deque()).append(base)
            self.idle_bytes += cap

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0
