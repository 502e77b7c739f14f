"""A remote reader's watch on its TCP link to the writer: a dropped link ends its wait instead of a silent hang.

ZeroMQ reconnects by itself, but the writer admits each reader once
(secure/aead.py), and what was sent while the link was down is gone either
way; so a reader that lost its link and then waits RAYFREE_LINK_GRACE_S for a
message raises QueueBroken instead of waiting forever. The check runs only
while the reader waits (once a slice at most), never on a message's path; the
grace lets the cluster's heartbeats name a lost node first.
"""

from __future__ import annotations

import logging
import time

import zmq

from rayfree import settings

from ..errors import QueueBroken
from .sockets import zmq_errors

__all__ = ["LinkWatch"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter


class LinkWatch:
    """Watches one subscriber's connection (a monitor socket on EVENT_DISCONNECTED)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, every_s: float) -> None:
        self.grace = settings.get("RAYFREE_LINK_GRACE_S")
        self.endpoint = endpoint
        self.every_s = every_s
        self._sock = sock
        with zmq_errors(f"watching the link to {endpoint}"):
            self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._check_at = 0.0
        self._lost_at: float | None = None

    @property
    def monitor(self) -> zmq.Socket:
        """The monitor socket, for a poll that a drop should end."""
        return self._monitor

    def left(self) -> float:
        """Seconds until a drop already seen would become QueueBroken (a large number while the link is up)."""
        return 3600.0 if self._lost_at is None else max(0.0, self._lost_at + self.grace - _perf())

    def check(self, what: str, force: bool = False) -> None:
        """Note a drop; QueueBroken once the link has been down for the grace with no message since. At most
        once a slice, unless `force` (a poll said the monitor has an event)."""
        now = _perf()
        if now < self._check_at and not force:
            return
        self._check_at = now + self.every_s
        mon = self._monitor
        with zmq_errors("", ignore=True):
            while mon.poll(0):
                mon.recv_multipart(zmq.NOBLOCK)  # the only event it reports is EVENT_DISCONNECTED
                if self._lost_at is None:
                    self._lost_at = now
                    logger.warning(
                        "%s: the TCP connection to the writer (%s) dropped; messages sent meanwhile are "
                        "lost, and the writer does not take this reader back",
                        what,
                        self.endpoint,
                    )
        if self._lost_at is not None and now - self._lost_at >= self.grace:
            raise QueueBroken(
                f"{what}: this reader's TCP connection to the writer ({self.endpoint}) dropped "
                f"{now - self._lost_at:.1f}s ago and no message has come since: what was sent "
                f"meanwhile is lost and the writer does not take a reconnected reader back. Check "
                f"the network between this node and the writer's, then restart the cluster."
            )

    def close(self) -> None:
        with zmq_errors("", ignore=True):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
