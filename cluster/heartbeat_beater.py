"""What both ends of the heartbeats share (heartbeat.py has the protocol and node 0's side, heartbeat_client.py a
follower's): the thread that owns one `ControlSocket`, its stop, and the rule that calls a silent peer lost."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from rayfree.supervisor import FailureDomain, Supervised, SupervisorMisuse, supervisor
from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_messages import Bye

__all__ = [
    "Beater",
    "RECONNECT_S",
    "IDLE_LOOK_S",
    "wait_ms",
    "WAIT_LOG_S",
    "STATUS_MAX_BYTES",
    "BYE_LINGER_MS",
    "LostCallback",
    "ByeCallback",
]

logger = logging.getLogger("rayfree.cluster")


#: How long a closing socket may take to put its goodbye on the wire.
BYE_LINGER_MS = 300
#: How often a waiting side says what it waits for.
WAIT_LOG_S = 10.0
#: A node status bigger than this is not sent (a beat over the sockets' 64 KiB limit would cut the link).
STATUS_MAX_BYTES = 48 << 10


#: on_lost(node_rank, ranks, ip, why) / on_bye(node_rank, clean, reason)
LostCallback = Callable[[int, list[int], str, str], None]
#: node 0's goodbye (node, clean, why); on a follower, True: it serves on without node 0 (it beats on, alone)
ByeCallback = Callable[[int, bool, str], bool | None]


#: how long a peer whose connection dropped has to connect and beat again before it is lost
RECONNECT_S = 0.3
#: the longest a heartbeat thread sleeps when nothing is due (what is due, arrives or stops wakes it sooner)
IDLE_LOOK_S = 1.0
#: a heartbeat thread that did not run for this share of the bound says so: its peers may call its node lost
STALL_SHARE = 1 / 3


class _SchedStat:
    """This thread's time on a CPU and waiting for one (Linux's /proc/thread-self/schedstat), read at every look
    through one descriptor the thread keeps (a pread, not an open per look): a stall's cause. Made and closed on
    the thread it measures; None where the file is missing."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float] | None:
        """(seconds on a CPU, seconds waiting for one) so far."""
        if self._fd is None:
            return None
        try:
            ran, waited = os.pread(self._fd, 128, 0).split()[:2]
            return int(ran) / 1e9, int(waited) / 1e9
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def wait_ms(due: float) -> int:
    """Milliseconds from now until `due` (monotonic), rounded up so the look finds it due."""
    return max(0, int((due - time.monotonic()) * 1000) + 1)


class Beater:
    """A thread that owns one socket (ZeroMQ sockets are not thread-safe) until `close()`; other threads only
    `stop` it, which wakes it at once."""

    _sock: ControlSocket

    def __init__(self, interval: float, timeout: float, name: str, who: str) -> None:
        if not 0 < interval < timeout:
            raise ValueError(f"heartbeat interval {interval}s must be positive and below the timeout {timeout}s")
        self.interval = interval
        self.timeout = timeout
        self.armed_at: float | None = None
        #: when a connection last dropped; a peer silent since then is lost after `suspect_window`
        self.suspect_at: float | None = None
        self.suspect_window = min(timeout, RECONNECT_S)
        #: when a connection's handshake was last made (None: none noted): a peer whose connection dropped before
        #: may be the one that reconnected (node 0), or this side reconnected (a follower): its window counts again
        self.reconnected_at: float | None = None
        #: the drop (its `suspect_at`) another signal confirmed (a collective's connection error): a peer silent
        #: since that drop is lost at once; a later drop has its window again (None: none confirmed)
        self.corroborated_at: float | None = None
        self.dropped = 0
        self._dropped_logged_at = 0.0
        self._stop = threading.Event()
        self._bye: Bye | None = None
        self._name = name
        self._thread: Supervised | None = None
        #: which node this thread beats for, in what it logs
        self.who = who
        #: when the thread last came back from waiting for messages (None: not yet)
        self._ran_at: float | None = None
        self._sched: tuple[float, float] | None = None
        self._schedstat: _SchedStat | None = None  # (made on the thread, at its first look)
        self._had_torch = "torch" in sys.modules
        #: when this thread last came back from a stall of its own: its peers' silence counts from then
        self._resumed_at = 0.0
        self._stall_logged_at: float | None = None

    def start(self, domain: FailureDomain | None = None) -> None:
        """Start the thread once its callbacks are wired (construct, wire, start: a beat that came before the
        wiring would meet none). A crash of the thread is a failure of `domain` (the node's policy: nothing would
        watch the peers any more), not a log line alone."""
        if self._thread is not None:
            raise SupervisorMisuse(f"{self._name} was started already")
        self._thread = supervisor().start(self._name, self._thread_main, stop=self.stop, domain=domain)

    def _thread_main(self) -> None:
        try:
            self._run()
        finally:
            if self._schedstat is not None:
                self._schedstat.close()

    def arm(self) -> None:
        """From now on, silence longer than the timeout is a loss."""
        self.armed_at = time.monotonic()
        self._sock.wake()  # (its deadlines start now)

    def corroborate(self) -> None:
        """A collective with a peer just broke with a connection error: if a connection dropped too, its silent
        peer is lost now, not a suspect window later (two signals agree)."""
        if self.suspect_at is not None:
            self.corroborated_at = self.suspect_at
            self._sock.wake()  # the silent peer is lost now, not at the end of its window

    def stop(self, bye: Bye | None = None) -> None:
        """Tell the thread to end, saying `bye` to the other side(s) first if given; returns at once."""
        if bye is not None and self._bye is None:
            self._bye = bye
        self._stop.set()
        self._sock.wake()

    def running(self) -> bool:
        return self._thread is not None and self._thread.alive()

    def join(self, timeout: float) -> bool:
        """Wait (bounded) until the thread has said its goodbye and closed its socket (never started: close it)."""
        if self._thread is None:
            self._sock.close()
            return True
        return self._thread.join(timeout)

    def close(self, bye: Bye | None = None, timeout: float = 5.0) -> None:
        """`stop`, then `join` (from another thread: a thread never stops itself)."""
        self.stop(bye)
        self.join(timeout)

    def _dropped(self, what: str) -> None:
        """Report a message that was dropped, once per burst (a broken peer must not flood the log). Counted after
        its line, where it has one: a count another thread reads never runs ahead of the log."""
        now = time.monotonic()
        if now - self._dropped_logged_at > 5.0:
            self._dropped_logged_at = now
            logger.warning("heartbeat: dropped %s; %d dropped so far", what, self.dropped + 1)
        self.dropped += 1

    def _receive(self, sock: ControlSocket, poll_ms: int) -> list[list[bytes]]:
        """Wait up to `poll_ms` for messages; a dropped connection makes the peer(s) suspect."""
        start = time.monotonic()
        got = sock.receive(poll_ms)
        now = time.monotonic()
        if self._schedstat is None:
            self._schedstat = _SchedStat()
        sched = self._schedstat.read()
        if self._ran_at is not None:
            # (the time between two looks, less the wait asked for: what the thread spent not running)
            stalled = start - self._ran_at + max(0.0, now - start - poll_ms / 1000)
            if stalled > self.timeout * STALL_SHARE:
                self._stalled(stalled, sched)
                self._resumed_at = now
        self._ran_at, self._sched, self._had_torch = now, sched, "torch" in sys.modules
        if sock.take_dropped():
            self.suspect_at = now
        return got

    def _stalled(self, seconds: float, sched: tuple[float, float] | None) -> None:
        """This thread did not run for `seconds`: the peers heard nothing from it meanwhile, and a stall past the
        bound reads to them as this node lost. Said (once per WAIT_LOG_S at most), so such a loss names its cause:
        how much of it the thread waited for a CPU, and how much it ran (the rest: Python's lock, or I/O)."""
        now = time.monotonic()
        if self._stall_logged_at is not None and now - self._stall_logged_at < WAIT_LOG_S:
            return
        self._stall_logged_at = now
        split = ""
        if sched is not None and self._sched is not None:
            ran, waited = sched[0] - self._sched[0], sched[1] - self._sched[1]
            split = f" (of which {waited:.2f}s waiting for a CPU, {ran:.2f}s running)"
        cause = (
            "the process was starved of CPU or stopped, or another thread held Python's lock that long (an entry "
            "point that imports torch inside the function does: import it at the top of the entry's module)"
        )
        if not self._had_torch and "torch" in sys.modules:
            cause = (
                "another thread of this process imported torch meanwhile, which holds Python's lock while its "
                "libraries load: import torch before the cluster starts (at the top of the entry's module)"
            )
        logger.warning(
            "%s: its heartbeat thread did not run for %.1fs%s (heartbeat_timeout_s=%s): %s; past the bound, the other "
            "nodes call this one lost",
            self.who,
            seconds,
            split,
            self.timeout,
            cause,
        )

    def _held_up(self) -> float:
        """When this thread last came back from a stall of its own (0.0: never), also one in the middle of a look,
        found before the next one. A peer's silence and reconnect window count from then at the earliest: while
        this thread could not run it could neither hear the peer nor beat so that the peer answers."""
        now = time.monotonic()
        if self._ran_at is not None and now - self._ran_at > self.timeout * STALL_SHARE:
            self._resumed_at = max(self._resumed_at, now)
        return self._resumed_at

    def _silence_due(self, last: float | None, dropped_at: float | None) -> float:
        """When `_silent` would first call this peer lost if it stays silent (armed only)."""
        assert self.armed_at is not None
        heard, resumed = max(last or 0.0, self.armed_at), self._held_up()
        due = max(heard, resumed) + self.timeout
        if dropped_at is not None and heard < dropped_at:
            due = min(due, self._window_from(dropped_at, resumed) + self._window(dropped_at))
        return due

    def _window_from(self, dropped_at: float, resumed: float) -> float:
        """When a dropped peer's reconnect window starts: at the drop, or later when this thread was held up, or
        when a connection was made since (under load a peer's reconnection may take most of its window, and its
        first beat on the new connection the rest; a process that died never reconnects). Each handshake lends
        at most one window more, and the silence bound holds over all."""
        start = max(dropped_at, resumed)
        if self.reconnected_at is not None and self.reconnected_at > dropped_at:
            start = max(start, self.reconnected_at)
        return start

    def _window(self, dropped_at: float | None) -> float:
        """How long a peer whose connection dropped at `dropped_at` has to beat again: none once a collective
        confirmed that drop. (Only that one: a replacement's link that drops and reconnects after a confirmed
        loss gets the whole window, or a reconnect under load would read as the replacement lost.)"""
        confirmed = self.corroborated_at is not None and dropped_at is not None and dropped_at <= self.corroborated_at
        return 0.0 if confirmed else self.suspect_window

    def _silent(self, last: float | None, now: float, dropped_at: float | None) -> str | None:
        """Why a peer last heard from at `last`, whose connection dropped at `dropped_at`, counts as lost now
        (None: it does not)."""
        assert self.armed_at is not None
        heard, resumed = max(last or 0.0, self.armed_at), self._held_up()
        if now - max(heard, resumed) > self.timeout:
            return f"no heartbeat for {now - heard:.1f}s (heartbeat_timeout_s={self.timeout})"
        window = self._window(dropped_at)
        if dropped_at is not None and heard < dropped_at and now - self._window_from(dropped_at, resumed) >= window:
            return (
                f"its connection dropped and it did not connect and beat again within {self.suspect_window:.1f}s "
                f"(its process died or was stopped, its host went down, or the link was cut)"
            )
        return None

    def _run(self) -> None:
        raise NotImplementedError
