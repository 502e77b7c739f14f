"""What node 0 knows of each follower: its connection, its last beat, and which process it is (a node started
again is another process, even where its pid is the same)."""

from __future__ import annotations

from .heartbeat_messages import Beat

__all__ = ["FollowerPeer", "process_of"]


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
