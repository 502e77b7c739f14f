"""How a process waits for a shared-memory flag: spin briefly, nap until the message is due, or park.

Spinning answers in about a microsecond but burns a core; parking costs a
wake-up (tens of microseconds) but nothing while idle. `SpinPolicy` spins only
while recent waits were short enough for spinning to pay off, so a tight
request/reply loop stays on the fast path and an idle reader sleeps. Between
the two, the reply to an engine's step comes after about as long as the last
ones: the reader naps until just before then and spins across it
(`SpinPolicy.expect`), prompt at a few percent of a core.

A parked waiter blocks reading its own FIFO (`WakePipe`); a notifier writes
one byte to it. A pipe rather than a futex because a pipe write is a *sync*
wake-up, which the scheduler may serve on the waker's core (a paced round
trip takes about half as long as with a futex: docs/benchmarks.md), and it
works on every POSIX system.

The protocol that makes parking safe: the waiter sets its `parked` byte,
fences, re-checks its condition, and only then blocks; the notifier
publishes, fences, and writes to every waiter whose `parked` byte is set.
One of the two always sees the other's store.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rayfree import settings

__all__ = ["SpinPolicy", "spin", "fence", "WakePipe", "sched_yield", "yield_interval", "note_ring_processes"]

T = TypeVar("T")

# A spinner yields the core now and then so that, with more spinning processes
# than cores, the one that must act next still runs. Which interval wins depends
# on how crowded the cores are (docs/benchmarks.md): so, every YIELD_US of
# spinning, or at every check once a ring has at least twice as many processes
# as there are cores.
_CORES = os.cpu_count() or 1
_crowded = False


def yield_interval() -> float:
    """Seconds of spinning between two yields of the core (RAYFREE_YIELD_US, read now)."""
    us = settings.get("RAYFREE_YIELD_US")
    if us is None:
        us = 0.0 if _crowded else 50.0
    return us / 1e6


def note_ring_processes(n: int) -> None:
    """This process uses a ring shared by `n` processes: yield at every check if they crowd the cores."""
    global _crowded
    if n >= 2 * _CORES:
        _crowded = True


_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release


def fence() -> None:
    """Full memory barrier (a locked instruction on x86) between a store and a later load.

    CPython has no fence primitive; acquiring a lock executes an atomic
    read-modify-write, which orders earlier stores before later loads.
    """
    _fence_acquire()
    _fence_release()


class SpinPolicy:
    """Decides how long the next wait may spin before it parks.

    It keeps a moving average of recent waits. While waits are short (a
    request/reply loop) the waiter spins up to 4x that average, capped by
    `spin_us`, and catches the next message without a wake-up; when they are
    long (a paced decode loop, an idle queue) it parks at once. `spin_us=0`
    never spins.
    """

    __slots__ = ("max_s", "avg", "limit", "_floor", "yield_s", "_recent", "_i", "_late", "_j")

    def __init__(self, spin_us: float | None = None) -> None:
        us = settings.get("RAYFREE_SPIN_US") if spin_us is None else float(spin_us)
        if us < 0:
            raise ValueError(f"spin_us must be >= 0 microseconds, got {spin_us}")
        self.max_s = us / 1e6
        self._floor = min(self.max_s, 20e-6)
        self.avg = 0.0
        self.limit = self._floor
        self.yield_s = yield_interval()
        #: the last RECENT waits (seconds; inf: none yet), and how late the last naps ended (`expect`)
        self._recent = [_FOREVER] * RECENT
        self._i = 0
        self._late = [NAP_LEAD_S] * RECENT
        self._j = 0

    def record(self, waited: float) -> None:
        """A wait of `waited` seconds just ended with a message."""
        cap = self.max_s
        a = self.avg = 0.8 * self.avg + 0.2 * min(waited, 2.0 * cap)
        if 2.0 * a < cap:
            lim = 4.0 * a
            self.limit = cap if lim > cap else (self._floor if lim < self._floor else lim)
        else:
            self.limit = 0.0
        i = self._i
        self._recent[i] = waited
        self._i = 0 if i + 1 == RECENT else i + 1

    def expect(self) -> tuple[float, float]:
        """A wait too long to spin through, after steps (recent waits all NAP_MAX_S or shorter): (how long to nap,
        how long to spin after it). The nap ends a lead before the shortest recent wait (the lead: how late the
        last naps ended, and a little), and the spin goes a little past it, so a reply as prompt as the last ones
        is caught by spinning, not by a wake-up. (0, 0): idle, waits too short to pay for the lead, or never
        spinning (spin_us 0): park."""
        if self.max_s <= 0 or max(self._recent) > NAP_MAX_S:
            return 0.0, 0.0
        shortest = min(self._recent)
        lead = min(NAP_LEAD_MAX_S, max(self._late) + NAP_LEAD_S)
        if shortest < NAP_LEADS * lead:  # (spinning a lead each time would cost more than parking)
            return 0.0, 0.0
        return shortest - lead, lead + max(NAP_LEAD_S, NAP_SPIN_SHARE * shortest)

    def record_nap(self, late: float) -> None:
        """A nap that was not woken ended `late` seconds after it was due (the timer's lateness here)."""
        j = self._j
        self._late[j] = late if late > 0.0 else 0.0
        self._j = 0 if j + 1 == RECENT else j + 1


#: `SpinPolicy.expect`: the waits (and naps) it remembers; the longest wait it naps through (after a longer one
#: it parks); how much sooner than the expected reply a nap ends, beyond the latest recent nap's lateness
#: (a timed wake-up's, at 1 us of timer slack: a few us on bare metal, tens in a VM), and at most; the share of
#: the wait it may spin past the expected reply
RECENT = 8
NAP_MAX_S = 0.1
#: a nap shorter than this is not worth its system call: spin through it; waits shorter than NAP_LEADS leads
#: park (spinning a lead through each would cost a large share of a core)
NAP_MIN_S = 10e-6
NAP_LEADS = 8
NAP_LEAD_S = 15e-6
NAP_LEAD_MAX_S = 200e-6
NAP_SPIN_SHARE = 0.02
_FOREVER = float("inf")

sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))
_perf = time.perf_counter


def spin(check: Callable[[], T | None], policy: SpinPolicy) -> T | None:
    """Call `check` until it returns non-None or the policy's spin limit passes."""
    t0 = _perf()
    end = t0 + policy.limit
    gap = policy.yield_s
    next_yield = t0 + gap
    while True:
        got = check()
        if got is not None:
            policy.record(_perf() - t0)
            return got
        now = _perf()
        if now >= end:
            return None
        if now >= next_yield:
            sched_yield()
            next_yield = now + gap


class WakePipe:
    """One waiter's wake-up FIFO.

    The waiter opens it with `WakePipe(path, waiter=True)` and blocks in
    `wait`; any process that opened it with `waiter=False` wakes it with
    `wake`. Bytes are only tokens: `wait` drains them all.
    """

    __slots__ = ("fd", "_poll", "waiter")

    @staticmethod
    def create(path: str) -> None:
        os.mkfifo(path, 0o600)

    def __init__(self, path: str, waiter: bool) -> None:
        # O_RDWR never blocks on open and keeps the FIFO alive after the
        # directory holding it is removed. The waiter's descriptor blocks;
        # a waker's does not (a full pipe already means 'wake up').
        self.fd = os.open(path, os.O_RDWR | (0 if waiter else os.O_NONBLOCK))
        self.waiter = waiter
        self._poll = None
        if waiter:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)

    def wake(self) -> None:
        try:
            os.write(self.fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float | None) -> None:
        """Block until woken or `timeout` seconds pass; None waits for a wake-up."""
        if timeout is None:
            os.read(self.fd, 4096)
        elif self._poll.poll(max(0, int(timeout * 1000 + 0.999))):
            os.read(self.fd, 4096)

    def nap(self, seconds: float) -> bool:
        """Block until woken (True) or `seconds` pass, to the microsecond (poll's timeout is whole milliseconds)."""
        _fine_timers()
        if select.select((self.fd,), (), (), seconds)[0]:
            os.read(self.fd, 4096)
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


_fine = threading.local()


def _fine_timers() -> None:
    """This thread's timed waits end within a microsecond of their time, not Linux's default 50 us of slack
    (prctl PR_SET_TIMERSLACK; elsewhere nothing changes): a nap that ends a lead before a reply must not end
    after it."""
    if getattr(_fine, "set", False):
        return
    _fine.set = True
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass
