"""Independent DP replicas over time: each one's epoch and state on a node, and node 0's admission of a lost
replica's replacement nodes (a rejoin).

A replica starts in epoch 0. When it is lost (failure_policy.py) its nodes exit non-zero and their launcher
starts them again with the same command. Node 0 admits such a replacement (a node whose replicas are all lost,
beating from a new process: Beat.incarnation; with the cluster's secret: its heartbeats are CURVE), gives the
replica its next epoch, and says so in its Welcome; the replacement's workers then meet alone, under that
epoch's name, at the store node 0's first rank still hosts, and form the replica's world again. Once every
node of the replica reports itself ready, node 0 marks the replica serving, runs the replica callbacks and
tells every follower (`ReplicaUp`). Messages of the lost incarnation are refused by the heartbeats, naming both epochs.
"""

from __future__ import annotations

import logging
from typing import Any

from rayfree.cluster.heartbeat_messages import ReplicaDown, ReplicaUp, Welcome, _encode
from rayfree.cluster.join import shape_of

from . import membership
from .abstract import ReplicaState
from .status_messages import decode_node

__all__ = ["ReplicaEpochs", "Rejoins"]

logger = logging.getLogger("rayfree.executor")


class ReplicaEpochs:
    """Every DP replica's epoch and state as this node knows them (node 0 knows every loss and rejoin)."""

    def __init__(self, lv: Any) -> None:
        self.lv = lv
        self.epochs = {k: 0 for k in range(lv.par.data_parallel_size)}
        #: the lost replicas node 0 admitted replacements for: dp rank -> the epoch they rejoin in
        self.rejoining: dict[int, int] = {}
        #: the replicas drained or draining (drain.py), until they rejoin
        self.draining: set[int] = set()
        #: how often each replica was lost, and rejoined, as this node heard (for /metrics)
        self.losses = dict.fromkeys(self.epochs, 0)
        self.rejoins = dict.fromkeys(self.epochs, 0)

    def lost(self, dp_rank: int) -> None:
        """Replica `dp_rank` was lost (the policy thread)."""
        self.losses[dp_rank] = self.losses.get(dp_rank, 0) + 1

    def states(self) -> dict[int, ReplicaState]:
        lost = self.lv.policy.lost
        out = {}
        for k, e in sorted(self.epochs.items()):
            if k in lost:
                gone = "drained" if k in self.draining else "lost"
                out[k] = ReplicaState("rejoining" if k in self.rejoining else gone, e, lost[k].summary)
            else:
                out[k] = ReplicaState("draining", e, "drained by the operator") if k in self.draining else (
                    ReplicaState("serving", e)
                )  # fmt: skip
        return out

    def back(self, dp_rank: int, epoch: int) -> None:
        """Replica `dp_rank` serves again, in `epoch` (the policy thread): every executor's callbacks hear it."""
        self.lv.policy.lost.pop(dp_rank, None)
        self.rejoining.pop(dp_rank, None)
        self.draining.discard(dp_rank)
        self.epochs[dp_rank] = epoch
        self.rejoins[dp_rank] = self.rejoins.get(dp_rank, 0) + 1
        logger.warning("DP replica %d rejoined (epoch %d) and serves again", dp_rank, epoch)
        if self.lv.node == 0:
            membership.declare(self.lv)  # (coupled replicas: the groups across replicas grow)
        for ex in self.lv.executors():
            ex.fire_replica_callbacks(dp_rank, ReplicaState("serving", epoch))


class Rejoins(ReplicaEpochs):
    """Node 0's part: admitting replacements, welcoming followers, and noticing a rejoined replica is ready."""

    def __init__(self, lv: Any) -> None:
        super().__init__(lv)
        self._announced: set[int] = set()
        self._admitted: dict[int, set[int]] = {}  # the nodes admitted so far in a rejoin
        self._refused: set[int] = set()  # the processes refused (said once)

    def admit(self, node: int, pid: int, shape: str = "") -> int | str | None:
        """The heartbeat thread: lost node `node` beats again from process `pid`, started as `shape`. Its epoch
        if admitted: every replica it runs is lost (a node of a replica that serves is not replaced under it),
        and it was started with the cluster's own shape and coupling; else why it is refused (it is told, and
        leaves: a refusal takes no epoch), or None."""
        par, lost = self.lv.par, self.lv.policy.lost
        ours = shape_of(par)
        if shape and shape != ours:
            why = (f"node {node}'s replacement (pid {pid}) was started as {shape!r} but the cluster is {ours!r}: "
                   f"start it with the cluster's own sizes and --replica-coupling")  # fmt: skip
            if pid not in self._refused:
                self._refused.add(pid)
                logger.warning("%s; refused", why)
            return why
        replicas = par.replicas_of_node(node)
        if par.one_world or not replicas or not all(k in lost for k in replicas):
            if pid not in self._refused:
                self._refused.add(pid)
                logger.warning("node %d beats again (pid %d), but its replicas %s are not lost: refused", node, pid,
                               replicas)  # fmt: skip
            return None
        for k in replicas:
            if k not in self.rejoining or node in self._admitted.get(k, ()):  # (a replacement that failed: anew)
                self._supersede(k, node)
                self.epochs[k] += 1
                self.rejoining[k] = self.epochs[k]
                self._admitted[k] = set()
                self._announced.discard(k)
            self._admitted[k].add(node)
            logger.warning(
                "node %d's replacement (pid %d) is admitted: DP replica %d rejoins in epoch %d", node, pid, k,
                self.rejoining[k],
            )  # fmt: skip
        return max(self.rejoining[k] for k in replicas)

    def _supersede(self, k: int, node: int) -> None:
        """Node `node` of rejoining replica k is replaced again (its replacement failed): the replica's nodes
        admitted in the epoch that ends wait for it in a rendezvous that will never complete; they are told,
        leave non-zero and are started again, into the next epoch."""
        stale = sorted(self._admitted.get(k, set()) - {node})
        if stale and self.lv.beater is not None:
            why = (f"its rejoin in epoch {self.epochs[k]} is given up (node {node}'s replacement failed) and starts "
                   f"again in epoch {self.epochs[k] + 1}: start this node again")  # fmt: skip
            logger.warning("DP replica %d: node(s) %s %s", k, stale, why.replace("start this node", "to be started"))
            self.lv.beater.tell(stale, ReplicaDown(k, node, [], why))

    def welcome(self, node: int) -> bytes:
        lost = [ReplicaDown(k, e.node_rank, e.ranks, e.why[:300]) for k, e in sorted(self.lv.policy.lost.items())]
        return _encode(Welcome(dict(self.epochs), [m for m in lost if m.dp_rank not in self.rejoining]))

    def look(self, server: Any) -> None:
        """The heartbeat thread, at each verdict: a rejoining replica whose nodes all beat and report themselves
        ready is back; the policy thread says so (`back`) and every follower is told."""
        if not self.rejoining:
            return
        ready = set()
        for node, _ip, _ranks, age, gone, raw in server.peer_views():
            try:
                if not gone and age is not None and raw and decode_node(raw).state == "ok":
                    ready.add(node)
            except Exception:  # noqa: BLE001 - an unreadable status is not ready
                continue
        for k, e in list(self.rejoining.items()):
            if k not in self._announced and all(n in ready for n in self.lv.par.nodes_of_replica(k)):
                self._announced.add(k)
                self.lv.policy.sup.call_later(0.0, self.back, k, e)
                server.tell(list(range(1, self.lv.par.nnodes)), ReplicaUp(k, e))
