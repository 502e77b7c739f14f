"""What node 0 and its followers say to each other over the heartbeat connection (msgspec, msgpack)."""

from __future__ import annotations

import msgspec

__all__ = [
    "Beat", "Bye", "Verdict", "StatusQuery", "ReplicaDown", "ReplicaUp", "DrainReplica", "Regroup", "Welcome",
    "Refused", "Disowned", "ScaleReplicas", "Resumed", "WidthSet", "WatchBy", "WatchLost", "Told",
]  # fmt: skip


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
    #: the cluster's shape as this node was started (join.shape_of), sent until node 0 welcomes it: a lost
    #: node's replacement is admitted only with the shape of the cluster it replaces a node of
    shape: str = ""
    #: drawn at random when the node's process starts: a process started again is another incarnation even where
    #: its pid is the same (pid 1 in a container the launcher restarted)
    incarnation: int = 0
    #: why this node lost node 0, once it did and serves its replicas without it (it beats on, to tell a node 0
    #: started again, which resumes the cluster from it, and one that was only cut off or stopped for a while,
    #: which counts it lost); "" before
    alone: str = ""
    #: with `alone`: every DP replica's epoch as this node knew them when it lost node 0 (frozen since: nothing is
    #: admitted without node 0); a node 0 started again resumes from them
    epochs: dict[int, int] = {}
    #: with `alone`: the replicas out of service as this node knows them (lost, drained), and the width the operator
    #: asked for (0: not known); a node 0 started again resumes them too
    out: list[ReplicaDown] = []
    requested: int = 0
    #: where this node watches its children (watch.py), if it has any: node 0 tells them; and which node watches
    #: this one (0: node 0, over this connection)
    watch: str = ""
    watcher: int = 0


class Bye(msgspec.Struct, tag="bye", array_like=True):
    """I stop on purpose; `clean` is False when the sender stops because something failed."""

    node_rank: int
    clean: bool
    reason: str


class Verdict(msgspec.Struct, tag="verdict", array_like=True):
    """Node 0's view of the cluster's readiness for one follower, pushed to it when it changes (its /readyz
    answers with it): "" ready, else why not. With independent DP replicas it is the readiness of the
    follower's own replicas."""

    reason: str


class ReplicaDown(msgspec.Struct, tag="replica-down", array_like=True):
    """Node 0 to the other nodes of an independent DP replica that lost a node (or a worker, a link): the
    replica stops; what it lost (its node and ranks) and why, and whether it was drained (a planned stop)."""

    dp_rank: int
    node_rank: int
    ranks: list[int]
    reason: str
    drained: bool = False


class ReplicaUp(msgspec.Struct, tag="replica-up", array_like=True):
    """Node 0 to every follower: an independent DP replica that was lost rejoined, in this epoch."""

    dp_rank: int
    epoch: int


class DrainReplica(msgspec.Struct, tag="drain", array_like=True):
    """`rayfree drain` to node 0 (which answers with one line of text), and node 0 to every follower: an
    independent DP replica drains (its calls in flight finish, then its nodes stop cleanly)."""

    dp_rank: int


class ScaleReplicas(msgspec.Struct, tag="scale", array_like=True):
    """`rayfree scale --dp N` to node 0, which answers with one line of text: the requested DP width."""

    width: int


class Regroup(msgspec.Struct, tag="regroup", array_like=True):
    """Node 0 to every follower, coupled DP replicas: membership epoch `epoch` is `members` (the replicas that
    serve); the groups across replicas are formed again over them."""

    epoch: int
    members: list[int]


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """Node 0's first answer to a follower (or to the replacement of a lost one, which it admitted): the epoch
    of every DP replica (0 at the cluster's start, one more at each rejoin), the replicas lost meanwhile
    (a replacement starts knowing them, as the nodes that heard it did), and the requested DP width."""

    epochs: dict[int, int]
    lost: list[ReplicaDown] = []
    requested: int = 0


class WidthSet(msgspec.Struct, tag="width", array_like=True):
    """Node 0 to every follower: the DP width the operator asked for is now `requested` (`rayfree scale`, or a
    scale-out given up): a follower that serves on without node 0 keeps it for a node 0 started again."""

    requested: int


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """Node 0 to a lost node's replacement it will not admit (another shape or coupling): why, in one line; the
    replacement exits 2."""

    reason: str


class Disowned(msgspec.Struct, tag="disowned", array_like=True):
    """Node 0 to a follower it counts lost (fallen silent, its connection dropped) whose same process beats
    again: node 0 will not take that process back (its replicas were failed without it); it leaves non-zero,
    for its launcher to start it again, instead of waiting for an answer that never comes."""

    reason: str


class Resumed(msgspec.Struct, tag="resumed", array_like=True):
    """A node 0 started again, once its own replicas serve, to a follower that serves without node 0 (it beats
    `alone`): node 0 leads the cluster again, and every replica's epoch is `epochs` (node 0's own in the one past
    the follower's), `lost` the replicas out of service meanwhile (the follower heard of none); the follower follows
    it again, as before its loss."""

    epochs: dict[int, int]
    lost: list[ReplicaDown] = []
    requested: int = 0


class WatchBy(msgspec.Struct, tag="watch-by", array_like=True):
    """Node 0 to a follower that has a watcher (watch.py): hold a quick link to it at `endpoint` (again, to a
    watcher's replacement)."""

    endpoint: str


class WatchLost(msgspec.Struct, tag="watch-lost", array_like=True):
    """A watcher to node 0: its child `node_rank`'s link dropped and did not come back, why."""

    node_rank: int
    reason: str


class StatusQuery(msgspec.Struct, tag="status?", array_like=True):
    """`rayfree status` asks node 0 for the cluster's status (it must hold the secret to get through)."""


#: what node 0 tells its followers of the replicas, at any time (HeartbeatServer.tell)
Told = ReplicaDown | ReplicaUp | DrainReplica | Regroup | WidthSet

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(
    Beat
    | Bye
    | Verdict
    | ReplicaDown
    | ReplicaUp
    | DrainReplica
    | Regroup
    | Welcome
    | Refused
    | Disowned
    | StatusQuery
    | ScaleReplicas
    | Resumed
    | WidthSet
    | WatchBy
    | WatchLost
).decode
