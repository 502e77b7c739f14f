"""Node 0's look at its followers' connections: whose dropped (a message to each, which ZeroMQ refuses for a
peer with no connection), and, with the watch on, the ping-only link of each follower node 0 watches itself.

With the watch on node 0 sends no pings: it holds each connection to the TTL its follower's pings carry. libzmq
disarms that TTL at every data frame (a beat) and arms it again only at the next ping, so a follower stopped or
cut off between a beat and its next ping would never be timed out by its beat connection. A follower whose
watcher is node 0 therefore also holds a link that carries nothing but pings (watch.py's `watch_link`, as every
watched child holds to its watcher): its TTL is always armed, and its drop is that follower's."""

from __future__ import annotations

import time

from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_messages import Beat, Verdict, _encode
from .heartbeat_peer import FollowerPeer
from .watch import routing_id

__all__ = ["Links", "FIND_DROPPED_S"]

#: how often node 0 asks, after a dropped connection, whose it was (ZeroMQ drops the peer's pipe a little later)
FIND_DROPPED_S = 0.05


class Links:
    """Mixed into `HeartbeatServer` (heartbeat.py has what each attribute means)."""

    peers: dict[int, FollowerPeer]
    _probed_at: float
    _look_at: float
    #: node 0 sends no pings (the watch is on): its own children hold a ping-only link to it
    _quiet: bool
    #: the followers whose ping-only link to node 0 was seen up (only theirs can be seen down)
    _pinging: set[int]

    def _saw_link(self, sock: ControlSocket, beat: Beat) -> None:
        """A beat of a follower node 0 watches itself, whose ping-only link is not known up yet: is it now?"""
        node = beat.node_rank
        if self._quiet and beat.watcher == 0 and node not in self._pinging:
            if sock.reachable([routing_id(node), b""]):
                self._pinging.add(node)

    def _find_dropped(self, sock: ControlSocket, at: float) -> None:
        """A connection dropped: whose? ZeroMQ refuses a message (the verdict) to a peer with no connection, and
        to a ping-only link that dropped. (Every FIND_DROPPED_S at most: one message to every follower each
        time.) A ping-only link seen down is looked for again at its node's next beats."""
        now = time.monotonic()
        if now - self._probed_at < FIND_DROPPED_S:
            return
        self._probed_at = now
        for peer in self.peers.values():
            if peer.identity is not None and not peer.gone and peer.dropped_at is None:
                k = peer.node_rank
                link_down = k in self._pinging and not sock.reachable([routing_id(k), b""])
                if link_down or not sock.reachable([peer.identity, _encode(Verdict(peer.verdict))]):
                    self._pinging.discard(k)
                    peer.dropped_at = at
                    self._look_at = 0.0
