"""How a waiting reader chooses to spin, nap or park (waiting.SpinPolicy): tables of recorded waits in, the
decision out (the policy reads no clock of its own); and the timed nap on a real wake-up FIFO, woken and not."""

from __future__ import annotations

import os
import time

import pytest

from rayfree.transport.shm.waiting import NAP_LEAD_MAX_S, NAP_LEAD_S, NAP_MAX_S, RECENT, SpinPolicy, WakePipe

MS = 1e-3


def _policy(waits: list[float], late: list[float] = (), spin_us: float = 200.0) -> SpinPolicy:
    pol = SpinPolicy(spin_us)
    for w in waits:
        pol.record(w)
    for x in late:
        pol.record_nap(x)
    return pol


@pytest.mark.parametrize(
    ("case", "waits", "late", "naps"),
    [
        ("fewer waits than it remembers: no rhythm yet", [5 * MS] * (RECENT - 1), [], False),
        ("steady 5 ms steps", [5 * MS] * RECENT, [], True),
        ("steady 1 ms steps", [1 * MS] * RECENT, [], True),
        ("steps of 1 to 30 ms", [1 * MS, 30 * MS, 5 * MS, 12 * MS] * (RECENT // 4), [], True),
        ("one idle gap among steps", [5 * MS] * (RECENT - 1) + [2 * NAP_MAX_S], [], False),
        ("the idle gap forgotten once RECENT steps followed", [2 * NAP_MAX_S] + [5 * MS] * RECENT, [], True),
        ("waits too short to pay for a lead (0.1 ms)", [0.1 * MS] * RECENT, [], False),
        ("naps that ended late: the lead grows past the step", [0.5 * MS] * RECENT, [NAP_LEAD_MAX_S] * RECENT, False),
    ],
)
def test_a_reader_naps_only_through_steady_steps_long_enough_to_pay_for_the_lead(case, waits, late, naps) -> None:
    nap, spin = _policy(waits, late).expect()
    assert (nap > 0 and spin > 0) is naps, (case, nap, spin)
    if naps:
        shortest = min(waits[-RECENT:])
        assert nap < shortest and nap + spin > shortest, (case, nap, spin)  # woken before it, spinning past it


def test_the_nap_ends_sooner_by_how_late_naps_ended_and_never_by_more_than_the_cap() -> None:
    steps = [10 * MS] * RECENT
    quiet, _ = _policy(steps).expect()
    late, _ = _policy(steps, [80e-6]).expect()
    capped, _ = _policy(steps, [1.0] * RECENT).expect()
    assert quiet == pytest.approx(10 * MS - 2 * NAP_LEAD_S)  # (the lead before any nap was timed)
    assert late == pytest.approx(10 * MS - 80e-6 - NAP_LEAD_S)
    assert capped == pytest.approx(10 * MS - NAP_LEAD_MAX_S)
    forgot, _ = _policy(steps, [80e-6] + [0.0] * RECENT).expect()  # a late nap long ago counts no more
    assert forgot == pytest.approx(10 * MS - NAP_LEAD_S)


def test_a_reader_told_never_to_spin_never_naps_either() -> None:
    assert _policy([5 * MS] * RECENT, spin_us=0).expect() == (0.0, 0.0)


@pytest.mark.timeout(30)
def test_a_nap_ends_on_its_time_or_at_once_when_woken(tmp_path) -> None:
    path = str(tmp_path / "wake")
    WakePipe.create(path)
    waiter, waker = WakePipe(path, waiter=True), WakePipe(path, waiter=False)
    try:
        t0 = time.perf_counter()
        assert waiter.nap(0.02) is False
        assert time.perf_counter() - t0 >= 0.02
        waker.wake()
        assert waiter.nap(20.0) is True  # (the pytest timeout bounds it, were the wake-up lost)
        assert waiter.nap(0.0) is False  # the wake-up was drained
    finally:
        waiter.close()
        waker.close()
        os.unlink(path)


_SLACK = """
import ctypes, os, threading
from rayfree.transport.shm.waiting import WakePipe
prctl = ctypes.CDLL(None).prctl
prctl(29, 50000, 0, 0, 0)  # PR_SET_TIMERSLACK: Linux's default (a parent that napped passes its own down)
got = {"main": prctl(30, 0, 0, 0, 0)}  # PR_GET_TIMERSLACK
def nap_once():
    got["before"] = prctl(30, 0, 0, 0, 0)
    path = os.path.join(os.environ["DIR"], "wake")
    WakePipe.create(path)
    WakePipe(path, waiter=True).nap(0.001)
    got["after"] = prctl(30, 0, 0, 0, 0)
t = threading.Thread(target=nap_once)
t.start()
t.join(10)
got["main after"] = prctl(30, 0, 0, 0, 0)
print(got)
"""


@pytest.mark.timeout(60)
def test_a_thread_that_naps_has_fine_timers_and_other_threads_keep_theirs(tmp_path) -> None:
    """Linux's timer slack (50 us by default) would end a nap that late: a napping thread asks for 1 us."""
    import ast
    import subprocess
    import sys

    from tests.support.paths import PYTHONPATH

    env = {**os.environ, "DIR": str(tmp_path), "PYTHONPATH": PYTHONPATH}
    out = subprocess.run([sys.executable, "-c", _SLACK], env=env, capture_output=True, text=True, timeout=50)
    got = ast.literal_eval(out.stdout.strip())
    assert got == {"main": 50000, "before": 50000, "after": 1000, "main after": 50000}, (got, out.stderr)
