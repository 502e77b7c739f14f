"""Where the tests' child processes find rayfree: the checkout first, then whatever PYTHONPATH the suite was run
with (rayfree's dependencies may come from there: a `pip install --target` directory, an HPC module system).
Tests prepend to PYTHONPATH; they never replace it."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath(*first: str) -> str:
    """`first` (default: the checkout), then the caller's PYTHONPATH."""
    parts = [*(first or (ROOT,)), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


#: the checkout, then the PYTHONPATH this suite runs with
PYTHONPATH = pythonpath()
