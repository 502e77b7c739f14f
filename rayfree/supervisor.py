"""One owner for every background thread of a process, and one road for every failure (torch elastic's PContext,
for threads).

Every thread rayfree runs is started here (`Supervisor.start`) under a name
that docs/architecture.md ("Threads and who stops them") lists with its owner,
what it waits on, what ends it and what it posts (tests/cluster/test_threads.py
compares that table with a running cluster's threads); `threading.Thread(`
appears in this module alone (tests/ops/test_house.py).

No thread acts on a failure itself. It posts a `Failure` (source, cause,
severity, and the domain it concerns) to the process's one inbox and goes on
or ends; one thread, RayfreePolicy, takes the inbox in order and hands each
record to its domain's `apply` (the executor layer's policy, executor/failure_policy.py).
The same thread runs what that policy schedules (`call_soon`, `call_later`:
the staged shutdown's steps, deadlines) and is the only one that stops other
threads, so no thread ever stops, or joins, itself (`Supervised.join` from the
thread itself is a misuse, and says so).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Severity", "Failure", "FailureDomain", "Supervised", "Supervisor", "supervisor", "SupervisorMisuse",
           "ThreadCrashed"]  # fmt: skip

logger = logging.getLogger("rayfree.supervisor")


class Severity(enum.IntEnum):
    """How a failure is handled; the staged shutdown's grace follows from it."""

    #: a stop asked for on purpose (an operator's signal, the engine's shutdown, node 0's goodbye): orderly
    STOP = 0
    #: the caller's own (a call interrupted mid-way): record it and tell the engine; the stop is the engine's
    CALLER = 1
    #: a worker process died: its peers on this node get a moment to notice and leave
    WORKER = 2
    #: a collective step raised, a node or a link was lost: ranks may wait in a collective that never ends
    FATAL = 3


class FailureDomain(Protocol):
    """What a failure concerns and how it is handled: `apply` runs on the policy thread, in posting order."""

    def apply(self, failure: Failure) -> None: ...


@dataclass(frozen=True)
class Failure:
    """One report: who noticed (`source`), what (`cause`: the error the engine will see, or None for a stop),
    how bad (`severity`), and the domain and executor it concerns."""

    source: str
    cause: Exception | None
    severity: Severity
    domain: FailureDomain | None = None
    executor: Any = None
    at: float = field(default_factory=time.monotonic)


class SupervisorMisuse(RuntimeError):
    """A thread asked to stop or join itself, or a thread was started outside the supervisor's rules."""


class ThreadCrashed(RuntimeError):
    """A thread that watches for the process (the heartbeats) raised: what it watched is watched no more, so the
    domain it was started for fails with this, instead of a log line that nobody acts on."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(
            f"rayfree's thread {name} crashed ({type(error).__name__}: {error}); what it watched for this node is "
            f"no longer watched, so the node stops (the traceback is in its log: please report it)"
        )
        self.thread_name = name


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` where `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm show it, as
    "rf-" and the rest of a "Rayfree..." name (Linux keeps 15 bytes); elsewhere, or if it fails, nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        short = "rf-" + name[len("Rayfree") :] if name.startswith("Rayfree") else name
        libc.prctl(15, short.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class Supervised:
    """One thread the supervisor started: what it is for, and how it is stopped."""

    def __init__(
        self,
        name: str,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        stop: Callable[[], None] | None,
        domain: FailureDomain | None = None,
    ) -> None:
        self.name = name
        self._stop = stop
        self._domain = domain
        self.thread = threading.Thread(target=self._run, args=(target, args), daemon=True, name=name)

    def _run(self, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
        name_os_thread(self.name)
        try:
            target(*args)
        except Exception as e:  # noqa: BLE001 - a thread that dies must not die silently
            logger.exception("thread %s failed", self.name)
            if self._domain is not None:  # (its domain hears of it: the policy fails what the thread watched for)
                supervisor().post(Failure(f"thread {self.name}", ThreadCrashed(self.name, e), Severity.FATAL,
                                          self._domain))  # fmt: skip
        finally:
            self._domain = None  # (an ended thread's record keeps no domain, nor what the domain holds, alive)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        """Tell the thread to end (what `ended_by` says); returns at once."""
        if self._stop is not None:
            self._stop()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` for the thread to end (True if it did). Never from itself."""
        if self.thread is threading.current_thread():
            raise SupervisorMisuse(f"thread {self.name} asked to wait for itself; its stop belongs to another thread")
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def join(self, timeout: float) -> bool:
        """`wait`, for a thread that should end now: one that does not is logged, and abandoned."""
        if self.wait(timeout):
            return True
        logger.warning("thread %s did not end within %.1fs; abandoning it", self.name, timeout)
        return False


class _Timer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Supervisor:
    """This process's threads and failure inbox (see the module docstring); `supervisor()` gives the one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[Supervised] = []
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, _Timer, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._policy: Supervised | None = None

    # -- threads --------------------------------------------------------------------------------------

    def start(
        self,
        name: str,
        target: Callable[..., Any],
        *,
        args: tuple[Any, ...] = (),
        stop: Callable[[], None] | None = None,
        domain: FailureDomain | None = None,
    ) -> Supervised:
        """Start a daemon thread `name` (one the threads table lists) running `target(*args)`; `stop` tells it to
        end (None: it ends on its own, as the table says); if `target` raises, `domain` gets a FATAL failure
        (`ThreadCrashed`), else the crash is logged only."""
        t = Supervised(name, target, args, stop, domain)
        with self._lock:
            self._threads = [x for x in self._threads if x.alive()]
            self._threads.append(t)
        t.thread.start()
        return t

    def threads(self) -> list[Supervised]:
        """The threads it started that are still running (the policy thread among them, once it runs)."""
        with self._lock:
            return [t for t in self._threads if t.alive()]

    # -- failures and the policy thread -----------------------------------------------------------------

    def post(self, failure: Failure) -> None:
        """Report `failure` (any thread; never blocks): the policy thread hands it to its domain."""
        self._ensure_policy()
        self._inbox.put(failure)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the policy thread, after what is in the inbox now."""
        self._ensure_policy()
        self._inbox.put((fn, args))

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> _Timer:
        """Run `fn(*args)` on the policy thread in `delay` seconds (unless the returned timer is cancelled)."""
        timer = _Timer()
        self.call_soon(self._schedule, time.monotonic() + max(0.0, delay), timer, fn, args)
        return timer

    def on_policy_thread(self) -> bool:
        p = self._policy
        return p is not None and p.thread is threading.current_thread()

    def _schedule(self, at: float, timer: _Timer, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        heapq.heappush(self._timers, (at, next(self._seq), timer, fn, args))

    def _ensure_policy(self) -> None:
        if self._policy is not None and self._policy.alive():
            return
        with self._lock:
            if self._policy is None or not self._policy.alive():
                self._policy = Supervised("RayfreePolicy", self._run_policy, (), None)
                self._threads.append(self._policy)
                self._policy.thread.start()

    def _run_policy(self) -> None:
        while True:
            timeout = None
            while self._timers:
                at, _, timer, fn, args = self._timers[0]
                if timer.cancelled:
                    heapq.heappop(self._timers)
                    continue
                timeout = at - time.monotonic()
                if timeout > 0:
                    break
                heapq.heappop(self._timers)
                self._guarded(fn, args)
                fn = args = None  # type: ignore[assignment]  # (what a step held is not kept alive by this loop)
                timeout = None
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                continue
            if isinstance(item, Failure):
                if item.domain is None:
                    logger.error("%s: %s (no domain handles it)", item.source, item.cause)
                else:
                    self._guarded(item.domain.apply, (item,))
            else:
                fn, args = item
                self._guarded(fn, args)
            item = fn = args = None  # (nor what the last report held)

    @staticmethod
    def _guarded(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the policy thread must outlive any one step
            logger.exception("the failure policy's step %s failed", getattr(fn, "__qualname__", fn))


_this: tuple[int, Supervisor] | None = None
_this_lock = threading.Lock()


def supervisor() -> Supervisor:
    """This process's supervisor (a forked child gets its own: threads do not survive a fork)."""
    global _this
    current = _this
    if current is None or current[0] != os.getpid():
        with _this_lock:
            if _this is None or _this[0] != os.getpid():
                _this = (os.getpid(), Supervisor())
            current = _this
    return current[1]
