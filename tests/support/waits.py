"""Waiting in tests: poll a condition until it holds, within a bound that names what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    cond: Callable[[], object], timeout: float = 10.0, what: str = "the condition", every: float = 0.01
) -> float:
    """Poll `cond` every `every` seconds until it is true; return how long that took, or fail after `timeout`
    naming `what`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(every)
    return time.monotonic() - t0
