"""What /proc says about a process: alive (not a zombie), its state, CPU time, process group, command line; and
leaving this process quickly once it has shut down (`exit_now`).

Linux only; every function answers "gone" rather than raising when the process is.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

__all__ = [
    "stat_fields",
    "is_alive",
    "proc_state",
    "cpu_seconds",
    "group_members",
    "descendants",
    "cmdline",
    "exit_now",
]

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state is [0], ppid [1], pgrp [2]); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """Running or sleeping, not gone and not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


_STATES = {
    "R": "running",
    "S": "sleeping (waiting)",
    "D": "in uninterruptible I/O",
    "T": "stopped (SIGSTOP?)",
    "t": "stopped by a debugger",
    "Z": "a zombie (exited)",
    "X": "gone",
    "I": "idle",
}


def proc_state(pid: int) -> str:
    """The process's scheduling state in words ("running", "stopped (SIGSTOP?)", ..., "gone")."""
    fields = stat_fields(pid)
    return "gone" if fields is None else _STATES.get(fields[0], f"in state {fields[0]}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _CLK


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))
        if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), whatever session or group they made."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(int(name))
            if fields is not None and len(fields) > 1 and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cmdline(pid: int, limit: int = 80) -> str:
    """The command line, spaces for NULs, cut to `limit` characters ('' if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return ""


def exit_now(code: int, run_atexit: bool = True) -> NoReturn:
    """Leave with `code` once this process has shut down what it owns: the atexit handlers run (not in a forked
    child, `run_atexit=False`: its handlers are its parent's, as multiprocessing's fork children never run them)
    and the streams are flushed, but the interpreter's teardown of every module and C++ static (about a second
    with torch loaded) is skipped, and so is a wait for non-daemon threads someone left running."""
    try:
        if run_atexit:
            atexit._run_exitfuncs()
        else:
            import multiprocessing.util

            multiprocessing.util._exit_function()  # what a forked child of multiprocessing runs on its way out
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
