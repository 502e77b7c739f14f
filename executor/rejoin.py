"""A node's membership, as the code around the roster (roster.py) sees it: the one door into it, the decisions
carried out, and node 0's admission of a lost replica's replacement nodes (a rejoin).

A replica starts in epoch 0. When it is lost (failure_policy.py) its nodes exit non-zero and their launcher
starts them again with the same command. Node 0 admits such a replacement (a node whose replicas are all lost,
beating from a new process: Beat.incarnation; with the cluster's secret: its heartbeats are CURVE), gives the
replica its next epoch, and says so in its Welcome; the replacement's workers then meet alone, under that
epoch's name, at the store node 0's first rank still hosts, and form the replica's world again. Once every
node of the replica reports itself ready, node 0 marks the replica serving, runs the replica callbacks and
tells every follower (`ReplicaUp`). Messages of the lost incarnation are refused by the heartbeats, naming both epochs.

Threads: the heartbeat thread sends admissions, readiness and the operator's requests; the policy thread
sends losses and what node 0 told a follower. Both come in through `ReplicaEpochs.send` (a lock around the
roster); what a decision does to the executors (their callbacks, a drain's wait, a regroup) runs on the policy
thread, and says so (`_on_policy`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_messages import (
    DrainReplica,
    Regroup,
    ReplicaDown,
    ReplicaUp,
    Resumed,
    Welcome,
    WidthSet,
    _encode,
)
from rayfree.cluster.join import shape_of
from rayfree.supervisor import SupervisorMisuse

from . import membership
from .abstract import ReplicaState
from .errors import ReplicaDrained, ReplicaLost
from .roster import Admit, Decision, Event, Ready, Roster, Tick
from .status_messages import decode_node

if TYPE_CHECKING:
    from .roles import Node

__all__ = ["ReplicaEpochs", "Rejoins", "down_of", "cause_of"]

logger = logging.getLogger("rayfree.executor")
_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR)
#: what a decision does on this node's executors: the policy thread's
_POLICY_KINDS = ("announce", "begin_drain", "regroup")


def down_of(err: ReplicaLost) -> ReplicaDown:
    """What node 0 tells of a replica out of service (drained: a planned stop)."""
    return ReplicaDown(err.dp_rank, err.node_rank, err.ranks, err.why[:300], isinstance(err, ReplicaDrained))


def cause_of(msg: ReplicaDown) -> ReplicaLost:
    """What a node hears of a replica out of service (`down_of`'s message) as the failure it is."""
    return (ReplicaDrained if msg.drained else ReplicaLost)(msg.dp_rank, msg.node_rank, msg.ranks, msg.reason)


class ReplicaEpochs:
    """Every DP replica's epoch and state as this node knows them (node 0 decides; a follower mirrors it)."""

    def __init__(self, lv: Node) -> None:
        self.lv = lv
        self.roster = Roster(lv.par)
        self._lock = threading.Lock()

    # -- the door -------------------------------------------------------------------------------------------------

    def send(self, ev: Event, act: bool = True) -> list[Decision]:
        """The one way into the roster (any thread): its decisions, carried out here but for those the sender
        acts on itself (stop_replica, node_ends, answer, admit, refuse, ignore); with `act` False, also those on
        the executors, which the sender then hands to `act` (the policy, after it failed the replica's own)."""
        with self._lock:
            out = self.roster.handle(ev)
        for d in out:
            if d.kind == "say":
                logger.log(_LEVELS[d.epoch], "%s", d.text)
            elif d.kind.startswith("tell_"):
                self._tell(d)
        if act:
            self.act(out)
        return out

    def act(self, decisions: list[Decision]) -> None:
        """What the decisions do on this node's executors: on the policy thread (from another: queued there)."""
        mine = [d for d in decisions if d.kind in _POLICY_KINDS]
        if mine:
            sup = self.lv.policy.sup
            if sup.on_policy_thread():
                self._on_policy(mine)
            else:
                sup.call_soon(self._on_policy, mine)

    def _tell(self, d: Decision) -> None:
        beater = self.lv.beater
        if not isinstance(beater, HeartbeatServer):  # (node 0 tells; one node has no followers)
            return
        if d.kind == "tell_down":
            err = d.cause
            assert err is not None
            # the lost replica's other nodes stop it, the others know whom not to route to (those gone are
            # skipped); or the nodes named: a rejoin given up
            to = list(d.nodes) or [k for k in self.lv.nodes()[1:] if k != err.node_rank]
            beater.tell(to, down_of(err))
        elif d.kind == "tell_up":
            beater.tell(self.lv.nodes()[1:], ReplicaUp(d.dp_rank, d.epoch))
        elif d.kind == "tell_drain":
            beater.tell(self.lv.nodes()[1:], DrainReplica(d.dp_rank))
        elif d.kind == "tell_width":
            beater.tell(self.lv.nodes()[1:], WidthSet(d.epoch))

    def _on_policy(self, decisions: list[Decision]) -> None:
        sup = self.lv.policy.sup
        if not sup.on_policy_thread():
            raise SupervisorMisuse("the roster's decisions on the executors run on the policy thread")
        from . import drain

        for d in decisions:
            if d.kind == "announce":
                assert d.state is not None
                for ex in self.lv.executors():
                    ex.fire_replica_callbacks(d.dp_rank, d.state)
            elif d.kind == "begin_drain":
                drain.begin(self.lv, d.dp_rank)
            elif d.kind == "regroup":
                if isinstance(self.lv.beater, HeartbeatServer):  # (node 0 of several)
                    self.lv.beater.tell(self.lv.nodes()[1:], Regroup(d.epoch, list(d.members)))
                membership.adopt(self.lv, d.epoch, list(d.members))

    # -- views (status, metrics, the probes, the engine's replica_states()) ---------------------------------------

    def out_of_service(self) -> tuple[list[ReplicaDown], int]:
        """The replicas out of service as this node knows them (one that drains counts drained: its nodes stop
        cleanly without node 0), and the requested width: what a node 0 started again resumes (Beat.out)."""
        return [down_of(e) for e in self.roster.out_of_service().values()], self.roster.requested

    def states(self) -> dict[int, ReplicaState]:
        return self.roster.states()

    @property
    def epochs(self) -> dict[int, int]:
        return self.roster.epochs()

    def drains(self, k: int) -> bool:
        """Does replica k drain, or was it drained (until it rejoins)? (Every call asks: one lookup.)"""
        return self.roster.phase(k) in ("draining", "drained")

    @property
    def rejoining(self) -> dict[int, int]:
        """The replicas node 0 admitted replacement nodes for: dp rank -> the epoch they rejoin in."""
        r = self.roster
        return {k: e for k, e in r.epochs().items() if r.phase(k) in ("rejoining", "starting")}

    @property
    def losses(self) -> dict[int, int]:
        return {k: self.roster.counts(k)[0] for k in self.roster.replicas()}

    @property
    def rejoins(self) -> dict[int, int]:
        return {k: self.roster.counts(k)[1] for k in self.roster.replicas()}


class Rejoins(ReplicaEpochs):
    """Node 0's part: admitting replacements, welcoming followers, and noticing a rejoined replica is ready."""

    def admit(self, node: int, pid: int, shape: str = "") -> int | str | None:
        """The heartbeat thread: lost node `node` beats again from process `pid`, started as `shape`. Its epoch
        if admitted (every replica it runs is out of service, and it was started with the cluster's own shape);
        else why it is refused (it is told, and leaves: a refusal takes no epoch), or None (its beats are
        dropped)."""
        out = self.send(Admit(node, pid, shape, shape_of(self.lv.par)))
        last = out[-1]
        return last.epoch if last.kind == "admit" else last.text if last.kind == "refuse" else None

    def welcome(self, node: int) -> bytes:
        gone = [down_of(e) for k, e in self.roster.lost().items() if k not in self.rejoining]
        return _encode(Welcome(self.epochs, gone, self.roster.requested))

    def resumed(self) -> bytes:
        """A node 0 started again, to a follower that served without it: every replica's epoch, and those out of
        service (lost, drained or rejoining: the follower heard of none while it served alone)."""
        lost = [down_of(e) for e in self.roster.lost().values()]
        return _encode(Resumed(self.epochs, lost, self.roster.requested))

    def look(self, server: HeartbeatServer, now: float) -> None:
        """The heartbeat thread, at each verdict: a replica whose nodes all beat and report themselves ready
        serves (again); a scale-out whose nodes did not come in time is given up."""
        if not self.rejoining:
            if self.roster.awaiting():
                self.send(Tick(now))
            return
        ready = set()
        for node, _ip, _ranks, age, gone, raw in server.peer_views():
            try:
                if not gone and age is not None and raw and decode_node(raw).state == "ok":
                    ready.add(node)
            except Exception:  # noqa: BLE001 - an unreadable status is not ready
                continue
        self.send(Ready(frozenset(ready), now))
