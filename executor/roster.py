"""The membership state machine: which DP replicas the cluster has, each one's phase and epoch, the width the
operator asked for and the width that serves. Events go in (`Roster.handle`), decisions come out.

It does no I/O, starts no thread and reads no clock: an event that needs the time carries it (`now`), so the
table tests in tests/executor/test_roster.py feed it event sequences, faults in every order, in milliseconds.
Node 0's roster decides (admissions, drains, widths, membership epochs); a follower's mirrors what node 0
tells it. The code around it (liveness.py, failure_policy.py, rejoin.py, drain.py) turns heartbeats and
failures into events and carries the decisions out; it reaches a roster through `RosterDoor` only.

A replica's phases (docs/architecture.md draws them):

    starting --ready--> serving --drain--> draining --its calls done--> drained
       ^                  |                   |                           |
       |                  +------lost---------+-----------> lost          |
       |                                                      |           |
       +--- scale out                 rejoining <--admitted---+-----------+
                                          |
                                          +--ready--> serving

`starting` is a replica a scale-out asked for whose nodes have not all come; `drained` is the quiesced phase
(its nodes exited 0). A cause's type carries its weight: `ReplicaDrained` is a planned stop (no loss counted),
any other `ReplicaLost` a loss.
"""

from __future__ import annotations

from rayfree.cluster.join import widens

from .abstract import ReplicaState
from .errors import ReplicaDrained, ReplicaLost
from .roster_events import (
    FOLLOWERS,
    KINDS,
    LEADERS,
    Admit,
    Back,
    Decision,
    Drain,
    DrainHeard,
    Event,
    Layout,
    Lost,
    Ready,
    Regrouped,
    Resume,
    RosterMisuse,
    Scale,
    Tick,
    Welcomed,
    WidthHeard,
)
from .roster_replica import ADMITS, MEMBER, OUT, PHASES, Replica
from .roster_width import WidthRules

__all__ = ["Roster", "PHASES", "Layout", "Lost", "Admit", "Ready", "Back", "Drain", "DrainHeard", "Scale", "Tick",
           "Regrouped", "Welcomed", "WidthHeard", "Resume", "Event", "Decision", "KINDS", "RosterMisuse"]  # fmt: skip


class Roster(WidthRules):
    """One node's membership state (module docstring). `handle` is its only writer."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.leader = layout.node_rank == 0
        dp = layout.data_parallel_size
        self._r = {k: Replica("serving") for k in range(dp)}
        #: the width the operator asked for (at start: the configured DP size)
        self.requested = dp
        #: the membership epoch: one more at every change of the members (coupled replicas form it)
        self.epoch = 0
        self.members: tuple[int, ...] = tuple(range(dp))
        self._refused: set[int] = set()  # the processes refused (said once)
        self._width_before: int | None = None  # (a scale-out's width to go back to if it is given up)
        self._spent: dict[int, int] = {}  # a new replica given up: the epoch it had

    # -- views (any thread may read them; only `handle` writes) --------------------------------------------------

    def phase(self, k: int) -> str:
        r = self._r.get(k)
        return r.phase if r is not None else "absent"

    def replicas(self) -> list[int]:
        return sorted(self._r)

    @property
    def effective(self) -> int:
        """How many replicas take calls now."""
        return sum(r.phase in MEMBER for r in self._r.values())

    def awaiting(self) -> bool:
        """Does a scale-out wait for its nodes (node 0 sends `Tick`s until it is met or given up)?"""
        return any(r.deadline is not None for r in self._r.values())

    def epochs(self) -> dict[int, int]:
        return {k: r.epoch for k, r in sorted(self._r.items())}

    def lost(self) -> dict[int, ReplicaLost]:
        """The replicas out of service (lost, drained, rejoining), each with the cause that took it out."""
        return {k: r.cause for k, r in sorted(self._r.items()) if r.phase in OUT and r.cause is not None}

    def out_of_service(self) -> dict[int, ReplicaLost]:
        """What a node 0 started again resumes from a follower (`Resume.out`): the replicas out of service, one
        that drains counted drained (its nodes stop cleanly without node 0)."""
        out = self.lost()
        for k, r in self._r.items():
            if r.phase == "draining":
                out[k] = ReplicaDrained(k, self.layout.nodes_of_replica(k)[0], [])
        return dict(sorted(out.items()))

    def counts(self, k: int) -> tuple[int, int]:
        """(losses, rejoins) of replica k, as this node heard them."""
        return (r.losses, r.rejoins) if (r := self._r.get(k)) is not None else (0, 0)

    def state(self, k: int) -> ReplicaState:
        r = self._r[k]
        why = {"draining": "drained by the operator", "starting": "a scale-out waits for its nodes"}.get(r.phase, "")
        if r.cause is not None and r.phase in OUT:
            why = r.cause.summary
        return ReplicaState(r.phase, r.epoch, why)

    def states(self) -> dict[int, ReplicaState]:
        return {k: self.state(k) for k in sorted(self._r)}

    # -- the one writer -------------------------------------------------------------------------------------------

    def handle(self, ev: Event) -> list[Decision]:
        if isinstance(ev, LEADERS if not self.leader else FOLLOWERS):
            role = "node 0" if self.leader else f"node {self.layout.node_rank}"
            raise RosterMisuse(f"{role}'s roster got {type(ev).__name__}, which its role never gets: {ev}")
        name = type(ev).__name__.lower()
        return getattr(self, f"_on_{name}")(ev)  # type: ignore[no-any-return]

    def _on_lost(self, ev: Lost) -> list[Decision]:
        k, r = ev.dp_rank, self._r.get(ev.dp_rank)
        if r is None:
            return [Decision("say", k, text=f"DP replica {k}: {ev.cause.summary} (not a replica of this cluster)")]
        if r.phase in OUT:
            node = ev.cause.node_rank  # (a node admitted to a rejoin, lost: the rejoin is given up)
            given_up = self.leader and r.phase == "rejoining" and node in r.admitted and len(r.admitted) > 1
            return [Decision("say", k, text=f"DP replica {k}: {ev.cause.summary} (lost already)")] + (
                self._given_up(k, r, node) if given_up else [])  # fmt: skip
        cause = ev.cause
        drained = isinstance(cause, ReplicaDrained) or r.phase == "draining"
        if drained and not isinstance(cause, ReplicaDrained):
            cause = ReplicaDrained(k, cause.node_rank, cause.ranks)
        r.phase, r.cause, r.deadline = ("drained" if drained else "lost"), cause, None
        r.losses += 0 if drained else 1
        out = [Decision("say", k, epoch=1 if drained else 2, text=str(cause))]
        if self.leader:
            out.append(Decision("tell_down", k, cause=cause))
        if k in self.layout.node_replicas:
            out.append(Decision("stop_replica", k, cause=cause))
        out.append(Decision("announce", k, state=self.state(k)))
        out += self._declare()
        mine = self.layout.node_replicas
        if k in mine and all(self.phase(j) in OUT for j in mine):
            clean = all(self.phase(j) == "drained" for j in mine)
            out.append(Decision("node_ends", k, epoch=int(clean), text=f"its DP replica(s) {mine} were " + (
                "drained" if clean else "lost")))  # fmt: skip
        return out

    def _on_admit(self, ev: Admit) -> list[Decision]:
        node, pid, lay = ev.node, ev.pid, self.layout
        replicas = lay.replicas_of_node(node)
        why = ""
        if not ev.shape:  # (a process welcomed or refused before beats without one: it is no replacement)
            return self._refuse(pid, "ignore", f"node {node} beats again (pid {pid}) without the shape it was "
                                               f"started as (a process refused before): refused")  # fmt: skip
        if ev.shape != ev.ours and not widens(ev.shape, ev.ours):
            why = (f"node {node}'s replacement (pid {pid}) was started as {ev.shape!r} but the cluster is "
                   f"{ev.ours!r}: start it with the cluster's own sizes and --replica-coupling (for a wider DP "
                   f"width, only --dp and --nnodes raised)")  # fmt: skip
        elif replicas and max(replicas) >= self.requested:
            why = (f"node {node} (pid {pid}) runs DP replica(s) {replicas}, past the requested width "
                   f"{self.requested}: ask for them first (`rayfree scale --dp {max(replicas) + 1}`)")  # fmt: skip
        elif any(self.phase(k) == "draining" for k in replicas):
            why = (f"node {node} (pid {pid}) came back while its DP replica(s) {replicas} drain: start it again "
                   f"once they have drained")  # fmt: skip
        if why:
            return self._refuse(pid, "refuse", why)
        if lay.one_world or not replicas or not all(self.phase(k) in ADMITS for k in replicas):
            return self._refuse(pid, "ignore", f"node {node} beats again (pid {pid}), but its replicas {replicas} "
                                               f"are not lost: refused")  # fmt: skip
        out = []
        for k in replicas:
            r = self._r.setdefault(k, Replica("starting"))
            fresh = r.phase == "starting" and not r.admitted
            if r.phase != "rejoining" and not fresh or node in r.admitted:  # (a replacement that failed: anew)
                out += self._given_up(k, r, node)
                if r.phase != "starting":
                    r.phase = "rejoining"
            r.admitted.add(node)
            text = f"node {node} (pid {pid}) is admitted: the scale-out's new DP replica {k} starts in epoch " \
                   f"{r.epoch}" if r.phase == "starting" else f"node {node}'s replacement (pid {pid}) is admitted: " \
                   f"DP replica {k} rejoins in epoch {r.epoch}"  # fmt: skip
            out.append(Decision("say", k, epoch=1, text=text))
        out.append(Decision("admit", max(replicas), epoch=max(self._r[k].epoch for k in replicas)))
        return out

    def _given_up(self, k: int, r: Replica, node: int) -> list[Decision]:
        """Node 0: node `node` of replica `k`'s rejoin failed (lost before the replica serves, or started again): the
        rejoin starts again in the next epoch; its other admitted nodes, waiting for what cannot come, are told."""
        stale, out = tuple(sorted(r.admitted - {node})), []
        if stale:
            why = (f"its rejoin in epoch {r.epoch} is given up (node {node}'s replacement failed) and starts again in "
                   f"epoch {r.epoch + 1}: start this node again")  # fmt: skip
            out.append(Decision("tell_down", k, nodes=stale, text=why, cause=ReplicaLost(k, node, [], why)))
        r.epoch += 1
        r.admitted = set()
        return out

    def _refuse(self, pid: int, kind: str, why: str) -> list[Decision]:
        said = why if kind == "ignore" else f"{why}; refused"
        out = [] if pid in self._refused else [Decision("say", epoch=1, text=said)]
        self._refused.add(pid)
        return out + [Decision(kind, text=why)]

    def _on_ready(self, ev: Ready) -> list[Decision]:
        out = []
        for k, r in sorted(self._r.items()):
            if r.phase in ("rejoining", "starting") and r.admitted:
                if all(n in ev.nodes for n in self.layout.nodes_of_replica(k)):
                    out += self._back(k, r.epoch)
        return out + self._on_tick(Tick(ev.now)) if ev.now else out

    def _on_back(self, ev: Back) -> list[Decision]:
        r = self._r.setdefault(ev.dp_rank, Replica("starting"))
        if r.phase in MEMBER and r.epoch >= ev.epoch:
            return []
        return self._back(ev.dp_rank, ev.epoch)

    def _back(self, k: int, epoch: int) -> list[Decision]:
        r = self._r[k]
        new = r.phase == "starting"
        r.rejoins += 0 if new else 1
        r.phase, r.epoch, r.cause, r.deadline, r.admitted = "serving", epoch, None, None, set()
        if self._width_before is not None and not self.awaiting():
            self._width_before = None  # (the scale-out is met)
        text = f"DP replica {k} (epoch {epoch}) serves: the scale-out's new replica" if new else (
            f"DP replica {k} rejoined (epoch {epoch}) and serves again")  # fmt: skip
        out = [Decision("say", k, epoch=1, text=text)]
        if self.leader:
            out.append(Decision("tell_up", k, epoch=epoch))
        return out + [Decision("announce", k, state=self.state(k))] + self._declare()

    def _on_drain(self, ev: Drain) -> list[Decision]:
        k, lay = ev.dp_rank, self.layout
        why = self._why_not_drain(k)
        if why:
            return [Decision("answer", k, text=f"refused: {why}")]
        nodes = tuple(lay.nodes_of_replica(k))
        text = (f"DP replica {k} drains: its calls in flight finish, then node(s) {list(nodes)} stop and exit 0. "
                f"Start them again with the same command to bring it back")  # fmt: skip
        return self._drain(k) + [Decision("tell_drain", k), Decision("answer", k, text=text)]

    def _why_not_drain(self, k: int) -> str:
        lay, dp = self.layout, len(self._r)
        if lay.data_parallel_size == 1 and dp == 1 or lay.one_world:
            return "only DP replicas with worlds of their own drain (" + (
                "this cluster has one replica)" if not lay.one_world else "these share one world: "
                "replica_coupling=one-world)")  # fmt: skip
        if k not in self._r:
            have = self.replicas()
            span = f"0-{have[-1]}" if have == list(range(len(have))) else str(have)
            return f"there is no DP replica {k} (replicas {span})"
        if self.phase(k) != "serving":
            return f"DP replica {k} is {self.phase(k)}, not serving"
        if all(j == k or self.phase(j) != "serving" for j in lay.replicas_of_node(0)):
            return f"DP replica {k} is the last one node 0 serves, and node 0 leads the cluster: it cannot stop"
        return ""

    def _drain(self, k: int) -> list[Decision]:
        self._r[k].phase = "draining"
        out = [Decision("say", k, epoch=1, text=f"DP replica {k} drains (nodes {self.layout.nodes_of_replica(k)})"),
               Decision("announce", k, state=self.state(k))] + self._declare()  # fmt: skip
        return out + ([Decision("begin_drain", k)] if k in self.layout.node_replicas else [])  # (after the regroup)

    def _in_groups(self, phase: str) -> bool:
        """Whether a replica in `phase` is a member of the groups across replicas. A coupled replica that drains
        is not: the survivors form groups without it before their next step (their step under way finishes on
        the old groups, beside its own), for it takes no new call, and a survivor's step that waited for it
        would hang until the groups' timeout."""
        return phase == "serving" or (phase == "draining" and not self.layout.coupled)

    def _on_drainheard(self, ev: DrainHeard) -> list[Decision]:
        return self._drain(ev.dp_rank) if self.phase(ev.dp_rank) == "serving" else []

    def _on_regrouped(self, ev: Regrouped) -> list[Decision]:
        if ev.epoch <= self.epoch:
            return []
        self.epoch, self.members = ev.epoch, tuple(ev.members)
        return [Decision("regroup", epoch=ev.epoch, members=self.members)]

    def _on_welcomed(self, ev: Welcomed) -> list[Decision]:
        for k, e in ev.epochs:
            self._r.setdefault(k, Replica("serving")).epoch = e
        self.requested = ev.requested or self.requested
        return []

    def _on_resume(self, ev: Resume) -> list[Decision]:
        """Node 0 started again: the followers' epochs are the cluster's, node 0's own replicas' one past theirs;
        the replicas they knew out of service are out of service (drained or lost), the width as they knew it."""
        mine = self.layout.node_replicas
        for k, e in (*ev.epochs, *((k, 0) for k in mine if k not in dict(ev.epochs))):
            r = self._r.setdefault(k, Replica("serving"))
            r.epoch, r.rejoins = (e + 1, r.rejoins + 1) if k in mine else (e, r.rejoins)
        for k, cause in ev.out:
            if k not in mine and k in self._r:
                r = self._r[k]
                r.phase, r.cause = ("drained" if isinstance(cause, ReplicaDrained) else "lost"), cause
        self.requested = ev.requested or self.requested
        for k in range(self.requested):  # (a scale-out's replica not serving yet when node 0 was lost: it may come)
            self._r.setdefault(k, Replica("starting", epoch=1))
        out = [f"DP replica {k} {self._r[k].phase}" for k, _ in ev.out if k not in mine and k in self._r]
        text = (f"node 0 was started again while node {ev.node} and the others served without it: it resumes the "
                f"cluster from their epochs; its DP replica(s) {mine} rejoin in epoch(s) "
                f"{[self._r[k].epoch for k in mine]}{''.join('; ' + o for o in out)}; the requested DP width is "
                f"{self.requested}")  # fmt: skip
        return [Decision("say", epoch=1, text=text)] + self._declare()

    def _declare(self) -> list[Decision]:
        """Node 0: the members changed: a new membership epoch (coupled replicas form it; followers are told)."""
        members = tuple(k for k, r in sorted(self._r.items()) if self._in_groups(r.phase))
        if not self.leader or not members or members == self.members:
            return []
        self.epoch += 1
        self.members = members
        if not self.layout.coupled:
            return []
        text = f"DP replicas {list(members)} form the groups across replicas again (membership epoch {self.epoch})"
        return [Decision("say", epoch=1, text=text), Decision("regroup", epoch=self.epoch, members=members)]
