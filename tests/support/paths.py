"""Where the tests' child processes find rayfree: the checkout first, then whatever PYTHONPATH the suite was run
with (rayfree's dependencies may come from there: a `pip install --target` directory, an HPC module system).
Tests prepend to PYTHONPATH; they never replace it."""

from __future__ import annotations

import os

from rayfree.testing import prepended_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath(*first: str) -> str:
    """`first` (default: the checkout), then the caller's PYTHONPATH."""
    return prepended_pythonpath(*(first or (ROOT,)))


#: the checkout, then the PYTHONPATH this suite runs with
PYTHONPATH = pythonpath()
