"""Node 0's side of a cluster that served without it (follower_liveness.py, `outlives_node_0`): the beats of
followers serving alone, and the first beats a node 0 started again holds until it knows whether it resumes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_beater import LostCallback
from .heartbeat_messages import Beat, Bye
from .heartbeat_peer import FollowerPeer

__all__ = ["Returns"]

logger = logging.getLogger("rayfree.cluster")


class Returns:
    """Mixed into `HeartbeatServer` (heartbeat.py has what each attribute means)."""

    peers: dict[int, FollowerPeer]
    armed_at: float | None
    on_lost: LostCallback
    on_alone: Callable[[int, Beat], None] | None
    adopt: Callable[[int, Beat], bytes | None] | None
    hold: Callable[[int], bool | str] | None
    heard: set[int]
    _alone_heard: set[int]
    _look_at: float
    #: nodes not to wait for, and why (`forget`: any thread puts them here, the heartbeat thread takes them)
    _to_forget: list[tuple[list[int], str]]
    _sock: ControlSocket

    def forget(self, nodes: list[int], why: str) -> None:
        """A node 0 started again resumed a cluster whose replicas on `nodes` were drained or lost meanwhile: it
        does not wait for them (no loss is called for their silence); started again, each is admitted as a
        replacement. Any thread; done on the heartbeat thread."""
        self._to_forget.append((nodes, why))
        self._sock.wake()

    def _forget_now(self) -> None:
        while self._to_forget:
            nodes, why = self._to_forget.pop(0)
            for node in nodes:
                peer = self.peers.get(node)
                if peer is not None and peer.last_seen is None and not peer.gone:
                    peer.gone, peer.lost_why = True, why
                    logger.info("node 0: node %d (ranks %s) is not waited for: %s", node, peer.ranks, why)

    def _alone(self, sock: ControlSocket, identity: bytes, msg: Beat) -> None:
        """A follower that lost node 0 and serves on without it beats (to a node 0 started again, or to this one
        after a cut or a stop). Starting, node 0 hears it (`on_alone`, once a node); running, it takes it back
        where it was started again to resume the cluster (`adopt`: the follower is told, and beats as before),
        else counts it lost."""
        peer, node = self.peers.get(msg.node_rank), msg.node_rank
        if self.armed_at is None:
            if self.on_alone is not None and node not in self._alone_heard:
                self._alone_heard.add(node)
                self.on_alone(node, msg)
        elif peer is not None and not peer.gone and self.adopt is not None and (told := self.adopt(node, msg)):
            peer.follows_again(identity, msg)  # (its silence counts from now)
            self._look_at = 0.0
            sock.try_send([identity, told])
        elif peer is not None and not peer.gone:
            peer.gone = True
            peer.lost_why = why = f"it serves on without node 0, which it lost ({msg.alone})"
            logger.error("follower node %d (%s, ranks %s) lost: %s", node, msg.ip, peer.ranks, why)
            self.on_lost(node, peer.ranks, msg.ip, why)

    def _held(self, peer: FollowerPeer, msg: Beat | Bye) -> bool:
        """Is this first beat held (see `hold`)? One counted lost is replaced at its next beat. One without the shape
        is an earlier node 0's follower's, sent before it knew that node 0 lost (ZeroMQ keeps it): `alone` follows."""
        assert self.hold is not None
        verdict = self.hold(peer.node_rank)
        if verdict is False:
            return False
        if isinstance(msg, Beat) and not msg.shape:
            return True
        self.heard.add(peer.node_rank)
        if isinstance(verdict, str) and isinstance(msg, Beat):
            peer.gone, peer.ip, peer.proc = True, msg.ip, None  # (its next beat: an admission)
            logger.warning("follower node %d (%s, ranks %s) lost: %s", peer.node_rank, msg.ip, peer.ranks, verdict)
            self.on_lost(peer.node_rank, peer.ranks, msg.ip, verdict)
        return True
