"""Node 0's liveness (`LeaderLiveness`: the heartbeat server every follower beats toward), and `for_node`,
which gives a node its role: node 0's, or a follower's (follower_liveness.py). What both share, and what a
node's liveness does, is node_liveness.py's."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_messages import Beat
from rayfree.cluster.join import JoinError
from rayfree.transport.net import bind_address

from . import drain
from .errors import NodeLost, ReplicaDrained, ReplicaLost
from .follower_liveness import FollowerLiveness, node_0_resumes
from .health import followers_verdict, verdicts
from .node_liveness import FINISH_POLL_S, NodeLiveness
from .rejoin import Rejoins, cause_of
from .roster import Resume
from .status_messages import cluster_status, encode

__all__ = ["NodeLiveness", "LeaderLiveness", "FollowerLiveness", "for_node"]

logger = logging.getLogger("rayfree.executor")

#: how often a node 0 that may have been started again looks whether its followers beat yet (once, at start)
_RESUME_POLL_S = 0.01


def for_node(config: ClusterConfig, replicas: int = 1, owner: Any = None) -> NodeLiveness:
    """This node's liveness, in its role, for `replicas` executors (`owner`: the executor that made it for
    itself, whose heartbeats end with it)."""
    cls = LeaderLiveness if config.parallel.node_rank == 0 else FollowerLiveness
    return cls(config, replicas, owner)


class LeaderLiveness(NodeLiveness):
    """Node 0: the heartbeat server every follower beats toward (none on a one-node cluster); it answers
    `rayfree status` and pushes its readiness verdict to the followers."""

    beater: HeartbeatServer | None

    def __init__(self, config: ClusterConfig, replicas: int = 1, owner: Any = None) -> None:
        super().__init__(config, replicas, owner)
        self.beater = None
        par, cfg = self.par, self.config
        #: the followers serve on without node 0 (follower_liveness.py), so a node 0 started again resumes them
        #: (its replicas started together, NodeReplicas: `welcome_epochs` decides before any worker starts)
        self.resumable = owner is None and node_0_resumes(par)
        self._own_nodes = set(par.nodes_of_replica(0)) - {0}
        #: followers heard serving without node 0 while this node starts (node -> its beat); the follower whose
        #: epochs this node 0 resumed the cluster from (None: it started the cluster), and those it took back
        self._alone: dict[int, Beat] = {}
        self._heard_alone = threading.Event()
        self.resumed_from: int | None = None
        self._taken_back: set[int] = set()
        #: set once every follower beat as a node starting with this one: a fresh cluster
        self._fresh = False
        if par.nnodes == 1:
            return
        others = {k: par.node_ranks(k) for k in range(1, par.nnodes)}
        self.beater = HeartbeatServer(
            bind_address(par.master_addr),
            cfg.heartbeat_endpoint_port,
            others,
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            self._node_lost,
            cfg.join_timeout_s,
        )
        self.beater.status_fn = lambda: encode(cluster_status(self))
        self.beater.verdict_fn = lambda: verdicts(self)
        rejoins, beater = self.replica_epochs, self.beater
        assert isinstance(rejoins, Rejoins)
        beater.welcome_fn = rejoins.welcome  # (always: a follower that disagrees on the coupling then joins, and
        # the join names the disagreement, instead of waiting for a welcome that would never come)
        if self.independent:  # (a lost replica's nodes may rejoin)
            beater.admit = rejoins.admit
            beater.verdict_fn = self._judged
            beater.drain_fn = lambda k: drain.request(self, k)
            beater.scale_fn = lambda n: drain.scale(self, n)
        beater.on_alone = self._served_without_me
        if self.resumable:
            beater.adopt, beater.hold = self._take_back, self._hold
        beater.start(self.policy)  # (wired: its first beat meets every callback; a crash of it fails the node)
        logger.info("node 0: heartbeat endpoint %s; waiting for %d other node(s) to join (join_timeout_s=%.0f)",
                    self.beater.endpoint, len(others), cfg.join_timeout_s)  # fmt: skip

    def _judged(self) -> dict[int, str]:
        """Node 0's heartbeat thread, at each verdict: the rejoins and scale-outs, then each follower's verdict."""
        assert isinstance(self.replica_epochs, Rejoins) and isinstance(self.beater, HeartbeatServer)
        self.replica_epochs.look(self.beater, time.monotonic())
        return verdicts(self)

    def _served_without_me(self, node: int, beat: Beat) -> None:
        """The heartbeat thread, while this node 0 starts: a node that lost node 0's earlier process serves its
        replicas without it (follower_liveness.py). Where every node outside node 0's own replica can, this node 0
        resumes the cluster from it (`welcome_epochs`); elsewhere the cluster this node 0 was started for cannot
        form."""
        if self.resumable and self.resumed_from is None and not self._fresh:
            self._alone.setdefault(node, beat)
            self._heard_alone.set()
            return
        if self.resumable and self.resumed_from is not None:
            return  # (resumed: taken back once this node 0 serves)
        self.fail_all(ConfigError(
            f"node {node} serves DP replica(s) {self.par.replicas_of_node(node)} without node 0 since it lost node "
            f"0's earlier process ({beat.alone}), but this node 0 cannot resume that cluster: it resumes one only "
            f"where every node outside its own replica serves on without it, as its own settings say (independent "
            f"replicas each on one node, or RAYFREE_WATCH_FANOUT as the others were started with), started by "
            f"`rayfree node` or NodeReplicas; start node 0 with the cluster's own command, or stop every node and "
            f"start it again"
        ))  # fmt: skip

    def welcome_epochs(self, timeout: float) -> dict[int, int]:
        """Where the followers serve on without node 0: is this node 0 starting the cluster (every follower beats
        as a node that starts: {}), or was it started again while they serve (one beats `alone`)? Then this node's
        replicas rejoin in the epoch past the followers' (`Resume`), meeting alone at a store of their own, and
        the followers are taken back once they serve (`_take_back`)."""
        beater = self.beater
        if not self.resumable or beater is None:
            return {}
        deadline = time.monotonic() + timeout
        while not self._alone:
            if all(p.last_seen is not None or k in beater.heard for k, p in list(beater.peers.items())):
                self._fresh = True
                return {}
            if self.settled.is_set():
                return {}
            if time.monotonic() > deadline:
                silent = sorted(
                    k for k, p in list(beater.peers.items()) if p.last_seen is None and k not in beater.heard
                )
                raise JoinError(
                    f"node 0: node(s) {silent} never beat to its heartbeats at {beater.endpoint} within "
                    f"{timeout:.0f}s (join_timeout_s): check that they started and can reach that address"
                )
            self._heard_alone.wait(_RESUME_POLL_S)
        node, beat = min(self._alone.items())
        self.resumed_from = node
        mine = set(self.par.node_replicas)
        out = {m.dp_rank: cause_of(m) for m in beat.out if m.dp_rank not in mine}
        self.replica_epochs.send(Resume(tuple(sorted(beat.epochs.items())), node, tuple(out.items()), beat.requested))
        self._forget_out(beater, node, out)
        epochs = self.replica_epochs.epochs
        return {k: epochs[k] for k in self.par.node_replicas}

    def _forget_out(self, beater: HeartbeatServer, told_by: int, out: dict[int, ReplicaLost]) -> None:
        """Resumed: the nodes whose every replica was drained or lost are not waited for (their silence
        is no news); started again, each is admitted as a lost node's replacement."""
        for k in sorted(set(list(beater.peers)) - self._own_nodes):  # (the heartbeat thread may add a newcomer)
            replicas = self.par.replicas_of_node(k)
            if replicas and all(r in out for r in replicas):
                how = "drained" if all(isinstance(out[r], ReplicaDrained) for r in replicas) else "lost"
                why = f"its DP replica(s) {replicas} were {how} before node 0 was started again, as node {told_by} knew"
                beater.forget([k], why + " (start it again to bring them back)")

    def _hold(self, node: int) -> bool | str:
        """The heartbeat thread, at a follower's first beat (as a node that starts, not `alone`): held until this
        node 0 knows whether it starts the cluster (then welcomed at its next beat) or resumes one: then it is a
        node started beside node 0 after its earlier process was lost too, counted lost and admitted as its
        replacement at its next beat (its replica rejoins in the next epoch, as any lost replica's nodes), unless
        it runs node 0's own replica, which left with node 0: started again with it, it rejoins with it."""
        if self._fresh:
            return False
        if self.resumed_from is None:
            return True
        if node in self._own_nodes:
            return False
        return ("it was started again while node 0 was away (the others served without node 0): its earlier "
                "process is lost, and node 0 admits it as its replacement")  # fmt: skip

    def _take_back(self, node: int, beat: Beat) -> bytes | None:
        """The heartbeat thread, once this node 0 serves: a follower that served without node 0 beats. Started
        again to resume the cluster, node 0 takes it back (a Resumed, encoded); else None (it is lost)."""
        if self.resumed_from is None:
            return None
        if node not in self._taken_back:
            self._taken_back.add(node)
            logger.info("node 0: node %d (%s), which served DP replica(s) %s without node 0, follows it again",
                        node, beat.ip, self.par.replicas_of_node(node))  # fmt: skip
        rejoins = self.replica_epochs
        assert isinstance(rejoins, Rejoins)
        return rejoins.resumed()

    def nodes(self) -> list[int]:
        return [0, *sorted(self.beater.peers)] if self.beater is not None else [0]

    def _node_lost(self, node: int, ranks: list[int], ip: str, why: str) -> None:
        replicas = self.par.replicas_of_node(node) if self.par.data_parallel_size > 1 else None
        self.policy.report("the heartbeats", NodeLost(node, ranks, ip, why, replicas))

    def peer_verdict(self, grace: float | None = None) -> str:
        return followers_verdict(self.beater, grace, self.lost_nodes()) if self.beater is not None else ""

    def finish(self) -> bool:
        """Wait for every other replica leader's `done` (or a failure), then the cluster may stop."""
        if self.beater is None:
            return self.failure is None
        leaders = [k for k in self.nodes()[1:] if self.par.leads(k)]
        if leaders:
            logger.info(
                "node 0: this node's replicas are done; waiting for the replica leader(s) on node(s) %s", leaders
            )
        while not self.settled.wait(FINISH_POLL_S):
            if self.beater.all_done([k for k in leaders if k not in self.lost_nodes()]):
                return True
        return self.failure is None
