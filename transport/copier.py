"""Copy a big payload into shared memory with several cores.

One core copies ~6 GB/s on a typical VM: 32 MiB then costs 5 ms, far more
than everything else on the path. `ctypes.memmove` releases the GIL, so a
few helper threads each copying a slice scale with memory bandwidth.
Knob: RAYFREE_COPY_THREADS (default: min(4, cores); 1 disables), read at the first big copy.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading

from rayfree import settings

__all__ = ["copy_into", "PARALLEL_MIN_BYTES"]

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
    started: a helper wakes ~50-100 us late on a virtual machine, which on a
    3 ms copy is worth not waiting for.
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
                    threading.Thread(target=_worker, args=(jobs,), name=f"rayfree-copy-{i}", daemon=True).start()
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
        dst[off: off + n] = src
        return
    jobs, threads = _pool()
    src_addr = _address(src) if threads > 1 else None
    if src_addr is None:
        dst[off: off + n] = src
        return
    job = _Copy(dst_addr + off, src_addr, n, 4 * threads)
    for _ in range(threads - 1):
        jobs.put(job)
    job.run()
    job.finished.wait()
