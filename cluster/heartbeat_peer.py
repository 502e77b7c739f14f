"""What node 0 knows of each follower: its connection, its last beat, and which process it is (a node started
again is another process, even where its pid is the same); and its goodbye to them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_messages import Beat, Bye, DrainReplica, ScaleReplicas, StatusQuery, Verdict, _decode, _encode

__all__ = ["FollowerPeer", "process_of", "log_waiting", "say_bye", "await_goodbyes", "tell_latecomers", "answer",
           "readable", "BYE_CONFIRM_S"]  # fmt: skip

logger = logging.getLogger("rayfree.cluster")

#: how long node 0 waits for its followers to read its goodbye before it closes its socket, and how often it looks
BYE_CONFIRM_S = 2.0
_BYE_POLL_MS = 20


class FollowerPeer:
    __slots__ = ("node_rank", "ranks", "ip", "identity", "last_seen", "gone", "done", "status", "dropped_at",
                 "bye_from", "pid", "proc", "epoch", "verdict", "lost_why")  # fmt: skip

    def __init__(self, node_rank: int, ranks: list[int]) -> None:
        self.node_rank = node_rank
        self.ranks = ranks
        self.ip = "?"
        self.identity: bytes | None = None
        self.last_seen: float | None = None
        self.gone = False
        self.done = False
        self.status = b""
        #: when node 0 found it had no connection any more (None: it has one, as far as node 0 knows)
        self.dropped_at: float | None = None
        #: the connection its goodbye came on: another than `identity` when two processes claim one node rank
        self.bye_from: bytes | None = None
        #: its process (pid, incarnation: Beat.incarnation), and its epoch (0: the cluster's start; more once a
        #: replacement was admitted)
        self.pid: int | None = None
        self.proc: tuple[int, int] | None = None
        self.epoch = 0
        #: the readiness verdict it was last sent
        self.verdict = "starting"
        #: why node 0 lost it ("": not lost, or it said goodbye)
        self.lost_why = ""

    def follows_again(self, identity: bytes, beat: Beat) -> None:
        """This node served without node 0 and a node 0 started again took it back: alive, heard now."""
        self.identity, self.ip, self.last_seen, self.dropped_at = identity, beat.ip, time.monotonic(), None
        self.pid, self.proc, self.status = beat.pid, process_of(beat), beat.status

    def reincarnate(self, beat: Beat, epoch: int) -> None:
        """A replacement of this lost node was admitted: a node that has not beaten yet, in `epoch`."""
        self.identity = self.last_seen = self.dropped_at = self.bye_from = None
        self.gone = self.done = False
        self.status = b""
        self.pid, self.proc, self.epoch, self.verdict = beat.pid, process_of(beat), epoch, "starting"
        self.lost_why = ""


def process_of(beat: Beat) -> tuple[int, int]:
    return beat.pid, beat.incarnation


def log_waiting(
    peers: dict[int, FollowerPeer], waited: float, join_timeout: float | None, serving: set[int] = frozenset()
) -> None:
    """Node 0, while followers are missing at start-up: which, for how long, out of how long (not those `serving`
    without an earlier node 0: they are taken back once this one serves)."""
    missing = [p for p in peers.values() if p.last_seen is None and not p.gone and p.node_rank not in serving]
    total = len(peers) + 1
    bound = f" of {join_timeout:.0f}s (join_timeout_s)" if join_timeout else ""
    for p in missing:
        logger.info("node 0: waiting for node %d of %d (ranks %s) for %.0fs%s; a node still starting (pulling "
                    "its image, say) is fine until then", p.node_rank, total, _span(p.ranks), waited,
                    bound)  # fmt: skip


def say_bye(sock: ControlSocket, peers: dict[int, FollowerPeer], bye: Bye | None) -> dict[int, bytes]:
    """Node 0's goodbye to every follower with a connection; returns whom it was sent to."""
    told: dict[int, bytes] = {}
    if bye is None:
        return told
    for peer in peers.values():  # (also one that beat as a node whose rank another claimed, and left)
        if peer.identity is not None and (not peer.gone or peer.bye_from not in (None, peer.identity)):
            sock.send_quietly([peer.identity, _encode(bye)])
            told[peer.node_rank] = peer.identity
    return told


def await_goodbyes(sock: ControlSocket, peers: dict[int, FollowerPeer], told: dict[int, bytes]) -> None:
    """ZeroMQ drops what its I/O thread has not sent yet when the process exits, and node 0 exits right after
    its goodbye: wait (bounded) until every follower told has dropped its connection, which it does once it
    read the goodbye. ZeroMQ refuses a message (a verdict, harmless if it comes after the goodbye) to a peer
    with no connection."""
    until = time.monotonic() + BYE_CONFIRM_S
    while told:
        told = {k: i for k, i in told.items() if sock.reachable([i, _encode(Verdict(peers[k].verdict))])}
        if not told or time.monotonic() >= until:
            break
        sock.receive(_BYE_POLL_MS)
    if told:
        logger.warning(
            "node 0: follower node(s) %s did not close their connection within %.1fs of node 0's goodbye; "
            "leaving anyway (they may learn of it only from the lost connection)",
            sorted(told),
            BYE_CONFIRM_S,
        )


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def tell_latecomers(
    sock: ControlSocket,
    peers: dict[int, FollowerPeer],
    bye: Bye,
    tell_s: float,
    receive: Callable[[], list[list[bytes]]],
) -> None:
    """After a failure (often at start-up), followers that have not beaten yet would only learn of it at their join
    timeout: answer their first beat with the goodbye, for up to `tell_s`."""
    waiting = {k for k, p in peers.items() if p.identity is None and not p.gone}
    until = time.monotonic() + tell_s
    while waiting and time.monotonic() < until:
        for identity, msg in readable(receive()):
            if isinstance(msg, Beat) and msg.node_rank in waiting:
                waiting.discard(msg.node_rank)
                sock.send_quietly([identity, _encode(bye)])


def readable(got: list[list[bytes]]) -> Iterator[tuple[bytes, Any]]:
    """Each (sender, message) that arrived as one, where a node is the other end (the rest is not ours: dropped)."""
    for frames in got:
        if len(frames) == 2:
            try:
                yield frames[0], _decode(frames[1])
            except msgspec.DecodeError:
                continue


def answer(server: Any, msg: StatusQuery | DrainReplica | ScaleReplicas) -> bytes:
    """Node 0's answer to `rayfree status` (the cluster's status, encoded), `rayfree drain` and `rayfree scale`
    (one line each), from the functions the layer above set on its HeartbeatServer."""
    line = not isinstance(msg, StatusQuery)
    try:
        if isinstance(msg, DrainReplica):
            return (server.drain_fn(msg.dp_rank) if server.drain_fn else "refused: nothing here drains").encode()
        if isinstance(msg, ScaleReplicas):
            return (server.scale_fn(msg.width) if server.scale_fn else "refused: this cluster has no DP replicas of "
                    "their own to scale").encode()  # fmt: skip
        return server.status_fn() if server.status_fn is not None else b""  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001 - a query must never stop the heartbeats
        logger.exception("heartbeat: could not answer a %s", type(msg).__name__)
        return f"refused: {type(e).__name__}: {e}".encode() if line else b""
