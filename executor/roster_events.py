"""The roster's words (roster.py): the layout it reads, the events that go in and the decisions that come out.
Plain frozen values, no behaviour: the code around the roster builds the events and reads the decisions."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from .abstract import ReplicaState
from .errors import ReplicaLost

__all__ = ["Layout", "Lost", "Admit", "Ready", "Back", "Drain", "DrainHeard", "Scale", "Tick", "Regrouped",
           "Welcomed", "WidthHeard", "Resume", "Event", "Decision", "KINDS", "RosterMisuse", "LEADERS",
           "FOLLOWERS"]  # fmt: skip


class Layout(Protocol):
    """Where replicas run (ParallelConfig is one): pure arithmetic, also past the width the cluster started at."""

    node_rank: int
    data_parallel_size: int

    @property
    def one_world(self) -> bool: ...
    @property
    def coupled(self) -> bool: ...
    @property
    def node_replicas(self) -> list[int]: ...
    def replicas_of_node(self, node: int) -> list[int]: ...
    def nodes_of_replica(self, dp_rank: int) -> list[int]: ...


# -- events -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Lost:
    """Replica `dp_rank` stopped: `cause` says how (a `ReplicaDrained` is a drain's planned end)."""

    dp_rank: int
    cause: ReplicaLost


@dataclasses.dataclass(frozen=True)
class Admit:
    """Node 0: node `node` beats from a new process `pid`, started as `shape` (its join key)."""

    node: int
    pid: int
    shape: str
    ours: str


@dataclasses.dataclass(frozen=True)
class Ready:
    """Node 0: the nodes that beat and report their workers ready, now."""

    nodes: frozenset[int]
    now: float = 0.0


@dataclasses.dataclass(frozen=True)
class Back:
    """A follower: node 0 says replica `dp_rank` serves again in `epoch`."""

    dp_rank: int
    epoch: int


@dataclasses.dataclass(frozen=True)
class Drain:
    """Node 0: the operator asks replica `dp_rank` to drain."""

    dp_rank: int


@dataclasses.dataclass(frozen=True)
class DrainHeard:
    """A follower: node 0 says replica `dp_rank` drains."""

    dp_rank: int


@dataclasses.dataclass(frozen=True)
class Scale:
    """Node 0: the operator (or the engine) asks for `width` DP replicas; new ones must serve by `now + wait_s`."""

    width: int
    now: float
    wait_s: float


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passes (node 0): a scale-out whose nodes did not come in time is given up."""

    now: float


@dataclasses.dataclass(frozen=True)
class Regrouped:
    """A follower: node 0 declared membership `epoch` over `members` (coupled replicas)."""

    epoch: int
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Welcomed:
    """A follower: node 0's first answer says each replica's epoch (a replacement joins a later one), and the
    width the operator asked for (0: not said)."""

    epochs: tuple[tuple[int, int], ...]
    requested: int = 0


@dataclasses.dataclass(frozen=True)
class WidthHeard:
    """A follower: node 0 says the operator's requested DP width is now `requested` (a scale, or one given up)."""

    requested: int


@dataclasses.dataclass(frozen=True)
class Resume:
    """Node 0, started again while the other nodes serve without it: each replica's epoch as one of them knew it
    when node 0 was lost; node 0's own replicas come back in the epoch past theirs."""

    epochs: tuple[tuple[int, int], ...]
    #: the follower that said so
    node: int
    #: the replicas out of service as it knew them (a ReplicaDrained: drained), and the requested width (0: unknown)
    out: tuple[tuple[int, ReplicaLost], ...] = ()
    requested: int = 0


Event = Lost | Admit | Ready | Back | Drain | DrainHeard | Scale | Tick | Regrouped | Welcomed | WidthHeard | Resume
#: what node 0 alone decides, and what a follower alone hears from it
LEADERS = (Admit, Ready, Drain, Scale, Tick, Resume)
FOLLOWERS = (Back, DrainHeard, Regrouped, Welcomed, WidthHeard)


class RosterMisuse(RuntimeError):
    """An event the roster's role never gets (a follower asked to admit, node 0 told of its own decision): a bug
    in the code around it, not the operator's input."""


# -- decisions ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the code around the roster must do; `kind` names it, the fields say with what."""

    kind: str
    dp_rank: int = -1
    epoch: int = 0
    text: str = ""
    members: tuple[int, ...] = ()
    nodes: tuple[int, ...] = ()
    cause: ReplicaLost | None = None
    state: ReplicaState | None = None


#: the decisions' kinds: say (log `text`; `epoch` 1 for a warning, 2 an error), answer (the request's reply),
#: refuse (an admission refused: `text` is told to the process), ignore (its beats are dropped: it is not the
#: node's replacement), admit (with `epoch`), announce (the replica
#: callbacks hear `state`), stop_replica (this node's executors of `dp_rank` stop with `cause`), node_ends
#: (this node has no replica left: `epoch` 1 if every one was drained, a clean stop), tell_down / tell_up /
#: tell_drain / tell_width (node 0 tells the followers; tell_down to `nodes` when set; tell_width the requested
#: width, in `epoch`), begin_drain (this node's leader of
#: `dp_rank` waits for its calls in flight), regroup (coupled replicas form membership `epoch` over `members`)
KINDS = ("say", "answer", "refuse", "ignore", "admit", "announce", "stop_replica", "node_ends", "tell_down", "tell_up",
         "tell_drain", "tell_width", "begin_drain", "regroup")  # fmt: skip
