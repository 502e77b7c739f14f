"""What node 0 knows of each follower: its connection, its last beat, and which process it is (a node started
again is another process, even where its pid is the same)."""

from __future__ import annotations

import logging

from .heartbeat_messages import Beat

__all__ = ["FollowerPeer", "process_of", "log_waiting"]

logger = logging.getLogger("rayfree.cluster")


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

    def reincarnate(self, beat: Beat, epoch: int) -> None:
        """A replacement of this lost node was admitted: a node that has not beaten yet, in `epoch`."""
        self.identity = self.last_seen = self.dropped_at = self.bye_from = None
        self.gone = self.done = False
        self.status = b""
        self.pid, self.proc, self.epoch, self.verdict = beat.pid, process_of(beat), epoch, "starting"
        self.lost_why = ""


def process_of(beat: Beat) -> tuple[int, int]:
    return beat.pid, beat.incarnation


def log_waiting(peers: dict[int, FollowerPeer], waited: float, join_timeout: float | None) -> None:
    """Node 0, while followers are missing at start-up: which, for how long, out of how long."""
    missing = [p for p in peers.values() if p.last_seen is None and not p.gone]
    total = len(peers) + 1
    bound = f" of {join_timeout:.0f}s (join_timeout_s)" if join_timeout else ""
    for p in missing:
        logger.info("node 0: waiting for node %d of %d (ranks %s) for %.0fs%s; a node still starting (pulling "
                    "its image, say) is fine until then", p.node_rank, total, _span(p.ranks), waited,
                    bound)  # fmt: skip


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)
