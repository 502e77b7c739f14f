"""Node 0's liveness (`LeaderLiveness`: the heartbeat server every follower beats toward), and `for_node`,
which gives a node its role: node 0's, or a follower's (follower_liveness.py). What both share, and what a
node's liveness does, is node_liveness.py's."""

from __future__ import annotations

import logging
import time
from typing import Any

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.transport.net import bind_address

from . import drain
from .errors import NodeLost
from .follower_liveness import FollowerLiveness
from .health import followers_verdict, verdicts
from .node_liveness import FINISH_POLL_S, NodeLiveness
from .rejoin import Rejoins
from .status_messages import cluster_status, encode

__all__ = ["NodeLiveness", "LeaderLiveness", "FollowerLiveness", "for_node"]

logger = logging.getLogger("rayfree.executor")


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
        beater.start(self.policy)  # (wired: its first beat meets every callback; a crash of it fails the node)
        logger.info("node 0: heartbeat endpoint %s; waiting for %d other node(s) to join (join_timeout_s=%.0f)",
                    self.beater.endpoint, len(others), cfg.join_timeout_s)  # fmt: skip

    def _judged(self) -> dict[int, str]:
        """Node 0's heartbeat thread, at each verdict: the rejoins and scale-outs, then each follower's verdict."""
        assert isinstance(self.replica_epochs, Rejoins) and isinstance(self.beater, HeartbeatServer)
        self.replica_epochs.look(self.beater, time.monotonic())
        return verdicts(self)

    def _served_without_me(self, node: int, why: str) -> None:
        """The heartbeat thread, while this node 0 starts: a node that lost node 0's earlier process serves its
        replicas without it (follower_liveness.py); the cluster this node 0 was started for cannot form."""
        self.fail_all(ConfigError(
            f"node {node} serves DP replica(s) {self.par.replicas_of_node(node)} without node 0 since it lost node "
            f"0's earlier process ({why}): a node 0 started again does not rejoin replicas that serve on; stop "
            f"every node, then start the cluster again"
        ))  # fmt: skip

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
