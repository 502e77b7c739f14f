"""A reader's pool of warm buffers for the private copies of big payloads.

Every reader gets its own writable copy of every tensor it receives (vLLM's
semantics: a TP rank that changes its input in place must not change its
peers'), so the ring's chunks are free the moment a message is read, however
long the caller keeps the tensor. Copying into fresh memory is mostly page
faults: measured here, 32 MiB into a new buffer 19-20 ms, into memory that was
used before 3 ms (1.5 ms on two cores). So a buffer goes back to this pool
when the caller has dropped the last tensor or view built on it (a weakref
on the ctypes object the views hang from), and the next message of that size
class gets it warm. What the caller keeps is never handed out again; the pool
holds at most `limit` bytes of idle buffers.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque

__all__ = ["BufferPool", "size_class"]

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
