"""Where a process's bytes live, read from /proc/self/maps (for workers that report on their arguments)."""

from __future__ import annotations


def in_shared_memory(address: int) -> bool | None:
    """True if `address` lies in a mapping of a /dev/shm file (a ring), False in another one, None if unmapped."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return "/dev/shm/" in line
    return None
