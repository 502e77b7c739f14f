"""A watched follower's side of the watch (watch.py): a child it watches lost, told to node 0, and, once node 0 is
lost and this node serves on without it (follower_liveness.py, `outlives_node_0`), what its own watch finds
decided by this node: a child lost, its own watcher lost, or its watcher's goodbye."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_beater import RECONNECT_S, ByeCallback
from .heartbeat_messages import Bye, WatchLost, _decode, _encode

__all__ = ["Watched"]

logger = logging.getLogger("rayfree.cluster")


class Watched:
    """Mixed into `HeartbeatClient` (heartbeat_client.py has what each attribute means)."""

    node_rank: int
    alone: str
    watcher: int
    on_bye: ByeCallback
    on_watch_lost: Callable[[int, str], None] | None
    _sock: ControlSocket
    _watch_link: ControlSocket | None
    _watch_down_at: float | None
    _children_lost: dict[int, str]
    _to_send: list[bytes]
    _dropped: Callable[[str], None]

    def _child_lost(self, node: int, why: str) -> None:
        """The watch's thread: a child of this node is lost; node 0 hears it from this node's thread, or, once node
        0 is lost too, the layer above decides (its replica, nobody else's)."""
        logger.error("node %d: node %d, which it watches, is lost: %s", self.node_rank, node, why)
        self._children_lost[node] = why
        if self.alone and self.on_watch_lost is not None:
            self.on_watch_lost(node, why)
            return
        self._to_send.append(_encode(WatchLost(node, why)))
        self._sock.wake()

    def _from_watcher(self, got: list[list[bytes]]) -> bool:
        """Its watcher's looks (dropped), and its goodbye, which it says only once it lost node 0 (this node may
        not know yet: its own link to node 0 waits longer): a clean one stops this node as node 0's would (True), a
        failed one is its replica lost."""
        for frames in got:
            if len(frames) != 1 or not frames[0]:
                continue
            try:
                msg = _decode(frames[0])
            except msgspec.DecodeError as e:
                self._dropped(f"an unreadable message from its watcher ({e})")
                continue
            if not isinstance(msg, Bye):
                continue
            logger.info("node %d: its watcher, node %d, stopped (%s)", self.node_rank, msg.node_rank, msg.reason)
            if not msg.clean:
                if self.on_watch_lost is not None:
                    self.on_watch_lost(msg.node_rank, f"it stopped after a failure: {msg.reason}")
                self._watch_down_at = None  # (said: its link's drop is no news)
                self._close_watch_link()
                continue
            return self.on_bye(msg.node_rank, True, msg.reason) is not True
        return False

    def _close_watch_link(self) -> None:
        if self._watch_link is not None:
            self._sock.unfollow(self._watch_link)
            self._watch_link.close()
            self._watch_link = None

    def _watch_link_lost(self, now: float) -> None:
        """Node 0 lost and this node serving on: is its watcher lost too (its link dropped and stayed down past the
        reconnect window)? Then its replica is, and the layer above hears it, once."""
        link = self._watch_link
        if link is None:
            return
        if link.take_connected():
            self._watch_down_at = None
        if link.take_dropped() and self._watch_down_at is None:
            self._watch_down_at = now
        down = self._watch_down_at
        if not self.alone or down is None or now - down < RECONNECT_S or self.on_watch_lost is None:
            return
        self._watch_down_at = None
        why = (
            f"its link to it dropped and did not come back within {RECONNECT_S}s, with node 0 lost (its process died "
            f"or was stopped, its host went down, or the link was cut)"
        )
        logger.error("node %d: its watcher, node %d, is lost: %s", self.node_rank, self.watcher, why)
        self.on_watch_lost(self.watcher, why)
