"""A replica leader's answers to `rayfree status` while node 0 is lost: the status as that node sees it.

Node 0 answers for the whole cluster from the heartbeats (heartbeat.py). Once it is lost, a node that serves on
without it (executor/follower_liveness.py) opens this desk at its own address, on the cluster's heartbeat port,
so `rayfree status --ask ADDRESS` reaches it with the cluster's secret as node 0 is reached. It refuses drains
and scale-outs: those are node 0's to decide, and a node serving alone decides nothing for the cluster. Never
opened on node 0's own address (a node 0 started again there needs that port), and a port another process holds
leaves the node without a desk, said once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rayfree.supervisor import supervisor
from rayfree.transport.errors import TransportError
from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_messages import DrainReplica, ScaleReplicas, StatusQuery
from .heartbeat_peer import answer, readable

__all__ = ["StatusDesk"]

logger = logging.getLogger("rayfree.cluster")

#: how long the desk waits for a query between looks at its stop (its wake pipe ends a wait at once)
_LOOK_MS = 1000


class StatusDesk:
    """Answers StatusQuery with `status_fn()` and refuses DrainReplica and ScaleReplicas with `refusal`, on a
    thread of its own, from `open` until `stop`."""

    def __init__(self, ip: str, port: int, status_fn: Callable[[], bytes], refusal: str) -> None:
        self.status_fn: Callable[[], bytes] | None = status_fn
        self.drain_fn = self.scale_fn = lambda _k: refusal
        self._sock = ControlSocket.listen(tcp_endpoint(ip, port))
        self.endpoint = self._sock.endpoint
        self._stop = threading.Event()

    @classmethod
    def open(cls, ip: str, port: int, node: int, status_fn: Callable[[], bytes], refusal: str) -> StatusDesk | None:
        """The desk, started; None where the port is held (said once: `rayfree status --ask` gets no answer)."""
        try:
            desk = cls(ip, port, status_fn, refusal)
        except TransportError as e:
            logger.warning("node %d: `rayfree status --ask %s` will not be answered here: %s", node, ip, e)
            return None
        supervisor().start("RayfreeStatusDesk", desk._run, stop=desk.stop)
        logger.info("node %d: answers `rayfree status --ask %s` at %s while node 0 is lost", node, ip, desk.endpoint)
        return desk

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                for identity, msg in readable(sock.receive(_LOOK_MS)):
                    if isinstance(msg, (StatusQuery, DrainReplica, ScaleReplicas)):
                        sock.try_send([identity, answer(self, msg)])
        finally:
            sock.close()

    def stop(self) -> None:
        """End the desk (returns at once; its thread closes the socket)."""
        self._stop.set()
        self._sock.wake()
