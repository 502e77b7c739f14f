"""Closed publishers kept until their remote readers have everything, and flushed before the process exits.

ZeroMQ drops whatever its I/O thread has not yet sent when the process
exits, and a publisher cannot learn what its subscribers received. So a
writer's close() sends CLOSE and hands its remote publisher here instead of
closing it. A reader drops its hello topic when it reads CLOSE, and ZeroMQ
drops it for a reader that disconnects; the XPUB reports either as
b"\\x00" + topic, and since messages are ordered that means the reader has
everything sent before CLOSE. A held publisher is closed once every reader
has reported, or when its deadline passes (with a warning naming the ranks
that did not). close() itself never waits: a reader in the same thread, or
one that reads only after close() returns, still gets everything. At exit
(normal interpreter exit, or a multiprocessing child's), `flush` waits for
the publishers still held, each until its own deadline.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import time

from ..errors import TransportError
from .sender import CLOSE, SocketSender

__all__ = ["hold", "flush"]

logger = logging.getLogger("rayfree.transport")

_lock = threading.Lock()
_held: list[_Held] = []
_hooked_pid = 0
_perf = time.perf_counter


class _Held:
    __slots__ = ("sender", "pending", "deadline", "limit", "close_sent", "pid")

    def __init__(self, sender: SocketSender, ranks: list[int], limit: float, close_sent: bool = False) -> None:
        self.sender = sender
        self.pending = set(ranks)
        self.limit = limit
        self.deadline = _perf() + limit
        self.close_sent = close_sent
        self.pid = os.getpid()

    def step(self, wait_ms: int) -> bool:
        """Send CLOSE if not yet sent, read reports; True when this one is finished (and closed)."""
        try:
            if not self.close_sent:
                self.close_sent = self.sender.send_control(CLOSE, block=False)  # refused while a reader lags
            if self.pending and self.close_sent:
                self.sender.read_close_acks(self.pending, wait_ms)
        except TransportError:  # the socket is unusable: nobody can confirm any more
            self.pending.clear()
        if self.pending and _perf() < self.deadline:
            return False
        if self.pending:
            logger.warning(
                "closed queue: remote reader rank(s) %s did not confirm its last messages within %.1fs "
                "(%s); they may miss them",
                sorted(self.pending),
                self.limit,
                "they have not read CLOSE" if self.close_sent else "they are too far behind for CLOSE",
            )
        self.sender.abort()
        return True


def hold(sender: SocketSender, ranks: list[int], limit: float, close_sent: bool = False) -> None:
    """Take over a writer's remote publisher at close(): CLOSE (unless a relay passed its writer's on already),
    then keep it until its readers confirm."""
    global _hooked_pid
    with _lock:
        pid = os.getpid()
        if _hooked_pid != pid:  # once per process (a forked child starts with the parent's list)
            _held[:] = [h for h in _held if h.pid == pid]
            multiprocessing.util.Finalize(None, flush, exitpriority=100)  # atexit, and in mp children
            _hooked_pid = pid
        h = _Held(sender, ranks, limit, close_sent)
        _held.append(h)
        _held[:] = [x for x in _held if not x.step(0)]  # finish whoever is done already


def flush() -> None:
    """Wait for every held publisher of this process until its readers confirm or its deadline passes."""
    with _lock:
        pid = os.getpid()
        mine = [h for h in _held if h.pid == pid]
        while mine:
            mine = [h for h in mine if not h.step(50 if len(mine) == 1 else 10)]
        _held.clear()
