"""Liveness as wide as a replica: which node watches which, and the watch itself.

With every follower's link to node 0 pinged ten times a second both ways, node 0's cost grows with the whole
cluster (hundreds of links). Here a node's quick link goes to its watcher instead: the first node of its
replica (node 0 for its own replica, and for each replica's first node), or, past `fanout` nodes, a node of
the replica's tree. The watcher holds its children to RAYFREE_LINK_TIMEOUT_S through libzmq's pings and tells
node 0 at once of a child whose link dropped and did not come back (`WatchLost`); each child's own link to
node 0 is held to the heartbeat timeout only (a process killed still drops it at once). A watcher lost is its
replica lost, so its children need no other watcher. Node 0's quick links are O(replicas + fanout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rayfree import settings
from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket

from .config import ParallelConfig
from .heartbeat_beater import BYE_LINGER_MS, RECONNECT_S, Beater, wait_ms
from .heartbeat_messages import Beat, WatchBy, _encode

__all__ = ["watch_on", "watchers", "WatchServer", "WatchBook", "watch_link", "routing_id"]

logger = logging.getLogger("rayfree.cluster")

#: how often a watcher whose child's connection dropped asks which one (ZeroMQ drops the pipe a little later), and
#: how often it looks otherwise (a child that connected before the watch's monitor was up is seen then)
FIND_DROPPED_S = 0.05
LOOK_S = 1.0


def watch_on() -> bool:
    """Is the watch on (RAYFREE_WATCH_FANOUT, the same on every node)?"""
    return bool(settings.get("RAYFREE_WATCH_FANOUT"))


def watchers(par: ParallelConfig, fanout: int | None = None) -> dict[int, int]:
    """Each follower's watcher (node 0 where it has none but node 0). A node's group is its replica's nodes where
    replicas fail alone, else the whole cluster; the group's first node watches the first `fanout` others, each
    of those the next `fanout`, as a heap. 0 (RAYFREE_WATCH_FANOUT=0): node 0 watches every node."""
    fanout = settings.get("RAYFREE_WATCH_FANOUT") if fanout is None else fanout
    out = {k: 0 for k in range(1, par.nnodes)}
    if fanout <= 0:
        return out
    apart = par.data_parallel_size > 1 and not par.one_world
    groups = {tuple(par.nodes_of_replica(r)) for r in range(par.data_parallel_size)} if apart else set()
    for group in groups or {tuple(range(par.nnodes))}:
        for i, k in enumerate(group[1:], 1):
            out[k] = group[(i - 1) // fanout]
    return out


def routing_id(node: int) -> bytes:
    return b"w%d" % node


def watch_link(endpoint: str, node: int) -> ControlSocket:
    """A child's quick link to its watcher: nothing but libzmq's pings travels on it (no thread of its own)."""
    return ControlSocket.connect(endpoint, routing_id=routing_id(node))


class WatchServer(Beater):
    """On a watcher: holds each child's link, and reports a child whose link dropped and stayed down past the
    reconnect window (`on_lost(node, why)`, from this thread), once armed."""

    def __init__(self, ip: str, children: list[int], timeout: float, on_lost: Callable[[int, str], None]) -> None:
        super().__init__(timeout / 4, timeout, "RayfreeWatchServer", f"watcher of {children}")
        self.children = {routing_id(k): k for k in children}
        self.on_lost = on_lost
        #: children whose link was seen (a child never seen is starting, not lost), and when each was missed
        self.seen: set[int] = set()
        self._missing: dict[int, float] = {}
        self._sock = ControlSocket.listen(tcp_endpoint(ip, 0), pings=False)
        self.endpoint = self._sock.endpoint

    def _run(self) -> None:
        sock = self._sock
        sock.watch()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                dropped = self.suspect_at is not None and now - self.suspect_at < 2 * RECONNECT_S
                self._receive(sock, wait_ms(now + (FIND_DROPPED_S if self._missing or dropped else LOOK_S)))
                sock.take_connected()
                self._look(sock)
        finally:
            bye = self._bye
            if bye is not None:  # (node 0 lost: its children hear from this node how their replica ended)
                for rid in self.children:
                    sock.send_quietly([rid, _encode(bye)])
            sock.close(BYE_LINGER_MS if bye is not None else 0)

    def _look(self, sock: ControlSocket) -> None:
        """Which children are connected (a look is a message to each, which ZeroMQ refuses for one with no
        connection)? One missing past the reconnect window is reported, once."""
        now = time.monotonic()
        for rid, k in self.children.items():
            if sock.reachable([rid, b""]):
                self.seen.add(k)
                self._missing.pop(k, None)
            elif k in self.seen:
                since = self._missing.setdefault(k, now)
                if self.armed_at is not None and now - since >= RECONNECT_S:
                    self.seen.discard(k)
                    del self._missing[k]
                    why = (
                        f"its link to it dropped and did not come back within {RECONNECT_S}s (its process died or "
                        f"was stopped, its host went down, or the link was cut)"
                    )
                    self.on_lost(k, why)


class WatchBook:
    """Node 0's record of the watch, as the beats say it: each follower's watcher (its own config's: a node added
    by a scale-out says its own), and where each watcher listens."""

    def __init__(self) -> None:
        self.of: dict[int, int] = {}
        self.at: dict[int, str] = {}

    def news(self, node: int, beat: Beat, first: bool) -> bool:
        """Does this beat change what the watch knows (then `heard` says it)? Most beats do not: a cheap look."""
        return bool(
            (beat.watcher and (first or self.of.get(node) != beat.watcher))
            or (beat.watch and self.at.get(node) != beat.watch)
        )

    def heard(self, node: int, beat: Beat, first: bool, send: Callable[[int, WatchBy], object]) -> None:
        """A beat of `node` (`first`: its process's first): it learns where its watcher is, when that is news to it,
        and its children where it watches, when that is news."""
        if beat.watcher and (first or self.of.get(node) != beat.watcher):
            self.of[node] = beat.watcher
            if beat.watcher in self.at:
                send(node, WatchBy(self.at[beat.watcher]))
        if beat.watch and self.at.get(node) != beat.watch:
            self.at[node] = beat.watch
            for child, w in self.of.items():
                if w == node:
                    send(child, WatchBy(beat.watch))
