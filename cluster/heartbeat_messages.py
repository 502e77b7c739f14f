"""What node 0 and its followers say to each other over the heartbeat connection (msgspec, msgpack)."""

from __future__ import annotations

import msgspec

__all__ = ["Beat", "Bye", "Verdict", "StatusQuery", "ReplicaDown", "ReplicaUp", "Welcome"]


class Beat(msgspec.Struct, tag="beat", array_like=True):
    """I am alive: a node's ranks and address (node 0 answers with node_rank 0); `done`: its entry points
    have returned and it waits for node 0 to stop the cluster."""

    node_rank: int
    ranks: list[int]
    ip: str
    pid: int
    seq: int
    done: bool = False
    #: the node's own status, opaque here (the executor layer's NodeStatus, encoded): node 0 keeps the last
    status: bytes = b""


class Bye(msgspec.Struct, tag="bye", array_like=True):
    """I stop on purpose; `clean` is False when the sender stops because something failed."""

    node_rank: int
    clean: bool
    reason: str


class Verdict(msgspec.Struct, tag="verdict", array_like=True):
    """Node 0's view of the whole cluster's readiness, pushed to every follower when it changes (each
    follower's /readyz answers with it): "" ready, else why not."""

    reason: str


class ReplicaDown(msgspec.Struct, tag="replica-down", array_like=True):
    """Node 0 to the other nodes of an independent DP replica that lost a node (or a worker, a link): the
    replica stops; what it lost (its node and ranks) and why."""

    dp_rank: int
    node_rank: int
    ranks: list[int]
    reason: str


class ReplicaUp(msgspec.Struct, tag="replica-up", array_like=True):
    """Node 0 to every follower: an independent DP replica that was lost rejoined, in this epoch."""

    dp_rank: int
    epoch: int


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """Node 0's first answer to a follower (or to the replacement of a lost one, which it admitted): the epoch
    of each DP replica the follower runs (0 at the cluster's start, one more at each rejoin)."""

    epochs: dict[int, int]


class StatusQuery(msgspec.Struct, tag="status?", array_like=True):
    """`rayfree status` asks node 0 for the cluster's status (it must hold the secret to get through)."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Beat | Bye | Verdict | ReplicaDown | ReplicaUp | Welcome | StatusQuery).decode
