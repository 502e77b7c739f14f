"""One DP replica as the roster (roster.py) records it: its phase, epoch, cause and counts; and which phases
serve and which admit a replacement. A record, no rules: the roster and its width rules (roster_width.py) write
it."""

from __future__ import annotations

import dataclasses

from .errors import ReplicaLost

__all__ = ["PHASES", "MEMBER", "ADMITS", "OUT", "Replica"]

PHASES = ("starting", "serving", "draining", "drained", "lost", "rejoining")
#: the phases whose replicas count as serving (the effective width). Coupled replicas' groups span the serving
#: ones only: a draining replica leaves them as its drain begins (`Roster._in_groups`)
MEMBER = ("serving", "draining")
#: the phases a replacement (or a new replica's node) may be admitted in
ADMITS = ("starting", "lost", "drained", "rejoining")
#: the phases of a replica out of service (its ReplicaLost says why)
OUT = ("lost", "drained", "rejoining")


@dataclasses.dataclass
class Replica:
    phase: str
    epoch: int = 0
    cause: ReplicaLost | None = None
    losses: int = 0
    rejoins: int = 0
    admitted: set[int] = dataclasses.field(default_factory=set)
    #: a scale-out's replica: when it is given up if its nodes have not all come
    deadline: float | None = None
