"""rayfree's names in /dev/shm and the runtime directory, and which of them a dead process left behind.

Every segment and ipc directory rayfree makes is named `rayfree-<creator pid>-...`,
so `rayfree doctor`, the demo and the tests can tell a live queue's from a leak.
"""

from __future__ import annotations

import os

from .net import runtime_dir
from .shm_ring import SEGMENT_PREFIX, SHM_DIR

__all__ = ["creator_pid", "creator_alive", "entries", "stale_entries", "remove_entries_of"]


def creator_pid(name: str) -> int | None:
    """The pid in a `rayfree-<pid>-...` name (None: not a name rayfree makes)."""
    base = os.path.basename(name)
    if not base.startswith(SEGMENT_PREFIX):
        return None
    try:
        return int(base[len(SEGMENT_PREFIX):].split("-", 1)[0])
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
