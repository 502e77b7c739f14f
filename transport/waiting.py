"""How a process waits for a shared-memory flag: spin briefly, then park.

Spinning answers in about a microsecond but burns a core; parking costs a
wake-up (tens of microseconds) but nothing while idle. `SpinPolicy` spins only
while recent waits were short enough for spinning to pay off, so a tight
request/reply loop stays on the fast path and a paced or idle reader sleeps.

A parked waiter blocks reading its own FIFO (`WakePipe`); a notifier writes
one byte to it. A pipe rather than a futex because a pipe write is a *sync*
wake-up: the scheduler may run the woken process on the waker's core, which
on virtual machines avoids waking a halted vCPU (measured: ~100 us for a
futex wake-up here, the cost of a pipe ping-pong for a pipe). It also works
on every POSIX system.

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
from typing import Callable, TypeVar

__all__ = ["SpinPolicy", "spin", "fence", "WakePipe", "DEFAULT_SPIN_US", "sched_yield"]

T = TypeVar("T")

#: Upper bound of the adaptive spin, in microseconds (knob: RAYFREE_SPIN_US).
#: 0 disables spinning: every wait parks at once.
DEFAULT_SPIN_US: float = float(os.environ.get("RAYFREE_SPIN_US", "200"))

# While spinning, yield the CPU every few checks so that, with more spinning
# processes than cores, the one that must act next still gets a core. With at
# least twice as many processes on a ring as cores, yield at every check
# (measured on 2 cores: 1 writer + 4 readers 57 us per round trip instead of
# 60-140 us; with 1 writer + 2 readers, every 4th check is better).
_YIELD_ENV = os.environ.get("RAYFREE_YIELD_EVERY")
_YIELD_EVERY = int(_YIELD_ENV or "4")
_CORES = os.cpu_count() or 1


def note_ring_processes(n: int) -> None:
    """This process uses a ring shared by `n` processes: adapt how often spinners yield."""
    global _YIELD_EVERY
    if _YIELD_ENV is None and n >= 2 * _CORES:
        _YIELD_EVERY = 1

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
    """Decides when a waiter spins, when it parks, and when it wakes up early.

    Reactive spin: a moving average of recent waits; while waits are short
    (a request/reply loop) the waiter spins up to 4x that average, capped by
    `spin_us`, and catches the next message without a wake-up. When waits are
    long, it parks at once.

    Early wake: when messages arrive at a steady period (an engine's decode
    loop), a parked waiter sets a timer to wake shortly before the next one
    is due and spins until it comes, so the message meets a running process
    instead of paying a cold wake-up. It does this only while the spin it
    costs stays under `PREDICT_BUDGET` of the period, and stops after a miss.
    """

    __slots__ = ("max_s", "avg", "limit", "_floor", "last", "gap", "dev", "late")

    def __init__(self, spin_us: float | None = None) -> None:
        us = DEFAULT_SPIN_US if spin_us is None else float(spin_us)
        if us < 0:
            raise ValueError(f"spin_us must be >= 0 microseconds, got {spin_us}")
        self.max_s = us / 1e6
        self._floor = min(self.max_s, 20e-6)
        self.avg = 0.0
        self.limit = self._floor
        self.last = 0.0   # when the last message was taken
        self.gap = 0.0    # moving average of the time between messages (0: unknown)
        self.dev = 0.0    # moving mean absolute deviation of that gap
        self.late = 200e-6  # how late a timer wake-up comes, learnt

    def record(self, waited: float, now: float) -> None:
        """A wait of `waited` seconds ended with a message at `now`."""
        cap = self.max_s
        a = self.avg = 0.8 * self.avg + 0.2 * min(waited, 2.0 * cap)
        if 2.0 * a < cap:
            lim = 4.0 * a
            self.limit = cap if lim > cap else (self._floor if lim < self._floor else lim)
        else:
            self.limit = 0.0
        if self.last:
            g = now - self.last
            if self.gap:
                self.dev = 0.8 * self.dev + 0.2 * abs(g - self.gap)
                self.gap = 0.8 * self.gap + 0.2 * g
            else:
                self.gap, self.dev = g, g / 4
        self.last = now

    def early_wake(self) -> tuple[float, float] | None:
        """(when to wake, when to give up spinning) before the next expected message, or None."""
        g, dev = self.gap, self.dev
        if not PREDICT_MIN_GAP_S <= g <= PREDICT_MAX_GAP_S or dev > 0.1 * g or self.max_s == 0:
            return None
        margin = 3.0 * dev + 30e-6
        window = max(3.0 * dev, 100e-6)
        if margin + window / 2 > PREDICT_BUDGET * g:  # the spin one early wake-up costs, on average
            return None
        lead = self.late + margin
        due = self.last + g
        return due - lead, due + window

    def timer_fired(self, late: float) -> None:
        self.late = 0.8 * self.late + 0.2 * min(max(late, 0.0), 2e-3)

    def missed(self) -> None:
        """The expected message did not come: forget the period until it shows again."""
        self.gap = self.dev = 0.0


#: Early wake-ups are used for periods in this range...
PREDICT_MIN_GAP_S = 1e-3
PREDICT_MAX_GAP_S = 0.25
#: ...and only while they cost at most this fraction of the period in spinning.
PREDICT_BUDGET = float(os.environ.get("RAYFREE_PREDICT_BUDGET", "0.08"))


sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))
_perf = time.perf_counter


def spin(check: Callable[[], T | None], policy: SpinPolicy, until: float | None = None) -> T | None:
    """Call `check` until it returns non-None or the spin limit (or `until`) passes."""
    t0 = _perf()
    end = t0 + policy.limit if until is None else until
    i = 0
    while True:
        got = check()
        if got is not None:
            now = _perf()
            policy.record(now - t0, now)
            return got
        if _perf() >= end:
            return None
        i += 1
        if i >= _YIELD_EVERY:
            i = 0
            sched_yield()


_FD_SETSIZE = 1024


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

    def wait(self, timeout: float | None) -> bool:
        """Block until woken (True) or `timeout` seconds pass (False); None waits for a wake-up."""
        fd = self.fd
        if timeout is None:
            os.read(fd, 4096)
            return True
        if fd < _FD_SETSIZE:  # microsecond timer, for early wake-ups
            ready = select.select((fd,), (), (), max(0.0, timeout))[0]
        else:
            ready = self._poll.poll(max(0, int(timeout * 1000 + 0.999)))
        if ready:
            os.read(fd, 4096)
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
