"""glibc's heap thresholds for a process that receives big messages from ZeroMQ: set once, where glibc's own rule ends.

ZeroMQ's I/O thread mallocs every big message it receives and the reader
frees it. glibc adjusts two thresholds as a process runs: a block freed that
had been mmapped raises the mmap threshold to its size (up to 32 MiB) and
the trim threshold to twice that; a free that leaves more than the trim
threshold at the top of an arena hands it back to the kernel (madvise
DONTNEED), and whatever is malloced there next faults its pages in afresh.
A sealed queue's big messages arrive as 1 MiB segments (aead.py), several in
flight at once, so a reader's thresholds settle at 1 and 2 MiB, its I/O
thread's arena is trimmed every few messages, and the next segments fault
again, costing a reader more CPU than opening them does (docs/benchmarks.md). A process with a remote reader therefore
starts where glibc's dynamic rule ends after it frees a single 32 MiB block
(mmap threshold 32 MiB, trim threshold 64 MiB), and stays there. Nothing
changes for a user who tunes malloc through the environment, for
RAYFREE_HEAP_TUNE=0, or off glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

from rayfree import settings

__all__ = ["keep_received_memory_warm", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

logger = logging.getLogger("rayfree.transport")

#: glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and the trim threshold it
#: sets beside it
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD = -1  # mallopt(3)
_M_MMAP_THRESHOLD = -3
#: the environment's own say over these thresholds (glibc's variables, its tunables): then rayfree leaves them be
_USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_USER_TUNABLES = (
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
    "glibc.malloc.top_pad",
    "glibc.malloc.mmap_max",
)

_lock = threading.Lock()
_applied: bool | None = None  # (a forked child inherits the thresholds with the answer)


def keep_received_memory_warm() -> bool:
    """Set the thresholds in this process, once; True when they are in force."""
    global _applied
    if _applied is None:
        with _lock:
            if _applied is None:
                _applied = _apply()
    return _applied


def _apply() -> bool:
    if not settings.get("RAYFREE_HEAP_TUNE"):
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(os.environ.get(v) for v in _USER_TUNING) or any(t in tunables for t in _USER_TUNABLES):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: a trim threshold alone would freeze the mmap threshold where it is (128 KiB at start)
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused; glibc's heap thresholds left as they are")
        return False
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        logger.debug("mallopt(M_TRIM_THRESHOLD) refused; only the mmap threshold is set")
        return False
    return True
