"""A follower node's liveness (node_liveness.py has what the roles share, liveness.py node 0's): it beats
toward node 0 with its status, hears node 0's word on the replicas, and stops with node 0's goodbye or its
loss, unless its independent replicas need nothing of node 0 (`outlives_node_0`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from rayfree import settings
from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.cluster.heartbeat_messages import Bye, ReplicaDown, Resumed
from rayfree.cluster.join import shape_of
from rayfree.cluster.status_desk import StatusDesk
from rayfree.cluster.watch import watchers
from rayfree.transport.net import is_local_address

from .errors import LeaderLost, NodeLost, ReplicaLost
from .health import follower_verdict
from .node_liveness import FINISH_POLL_S, NodeLiveness
from .rejoin import cause_of
from .roster import Back, DrainHeard, Regrouped, Welcomed, WidthHeard
from .status_messages import cluster_status, encode, node_status

__all__ = ["FollowerLiveness", "outlives_node_0", "node_0_resumes"]

logger = logging.getLogger("rayfree.executor")


def outlives_node_0(par: ParallelConfig, fanout: int | None = None) -> bool:
    """Does this node serve on when node 0 is lost (its loss costing node 0's replicas only)? Where its replicas
    are independent (coupled ones' groups across replicas re-form as node 0 declares; one world fails together)
    and each runs on this node alone, or, with the watch on (RAYFREE_WATCH_FANOUT), on nodes that watch each other
    (cluster/watch.py) and not on node 0: without the watch, a replica spread over nodes has node 0 as its only
    watcher."""
    if par.data_parallel_size == 1 or par.one_world or par.coupled or par.node_rank == 0:
        return False
    if all(par.nodes_of_replica(k) == [par.node_rank] for k in par.node_replicas):
        return True
    fanout = settings.get("RAYFREE_WATCH_FANOUT") if fanout is None else fanout
    return fanout > 0 and all(0 not in par.nodes_of_replica(k) for k in par.node_replicas)


def node_0_resumes(par: ParallelConfig, fanout: int | None = None) -> bool:
    """Does a node 0 started again resume the cluster (liveness.py)? Where every other node serves on when node 0
    is lost (`outlives_node_0`), but those of node 0's own replica: they leave with it, and are started again with it,
    their replica rejoining with node 0's in the epoch past the others'."""
    own = set(par.nodes_of_replica(0))
    others = [k for k in range(1, par.nnodes) if k not in own]
    return bool(others) and all(outlives_node_0(msgspec.structs.replace(par, node_rank=k), fanout) for k in others)


class FollowerLiveness(NodeLiveness):
    """Any other node: beats toward node 0 with its status; node 0 lost, or its goodbye, stops this node."""

    beater: HeartbeatClient

    def __init__(self, config: ClusterConfig, replicas: int = 1, owner: Any = None) -> None:
        super().__init__(config, replicas, owner)
        par, cfg = self.par, self.config
        self.outlives_node_0 = outlives_node_0(par)
        #: why node 0 was lost, once it was and this node serves on; where it answers `rayfree status` meanwhile
        self.node_0_lost = ""
        self._desk: StatusDesk | None = None
        self._closing = False
        self._desk_lock = threading.Lock()
        tree = watchers(par)  # (who holds this node's quick link, and whose this node holds: watch.py)
        self.beater = HeartbeatClient(
            par.master_addr,
            cfg.heartbeat_endpoint_port,
            self.node,
            par.node_ranks(self.node),
            self.ip,
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            self._node_0_lost,
            self._head_bye,
            shape_of(par),  # (a replacement of a lost node is admitted only with the cluster's shape)
            tree.get(self.node, 0),
            [k for k, w in tree.items() if w == self.node],
        )
        self.beater.status_fn = lambda: encode(node_status(self))
        self.beater.on_disowned = lambda why: self.policy.report("node 0", NodeLost(
            self.node, par.node_ranks(self.node), self.ip,
            f"node 0 counts it lost ({why}) and will not take this process back: start the node again",
        ))  # fmt: skip
        if self.independent:  # (what node 0 says reaches the roster on the policy thread, in the order it came)
            send, soon = self.replica_epochs.send, self.policy.sup.call_soon
            self.beater.on_replica_down = self._replica_down
            self.beater.on_replica_up = lambda m: soon(send, Back(m.dp_rank, m.epoch))
            self.beater.on_replica_drain = lambda m: soon(send, DrainHeard(m.dp_rank))
            self.beater.on_regroup = lambda m: soon(send, Regrouped(m.epoch, tuple(m.members)))
            self.beater.on_width = lambda m: soon(send, WidthHeard(m.requested))
            self.beater.alone_out = self.replica_epochs.out_of_service
        if self.outlives_node_0:
            self.beater.on_resumed = self._node_0_back
            self.beater.on_watch_lost = self._watched_lost
        self.beater.start(self.policy)  # (wired: node 0's first word meets every callback; a crash fails the node)
        logger.info("node %d: waiting for node 0 at %s:%d (heartbeats at %s) to form the world (join_timeout_s=%.0f)",
                    self.node, par.master_addr, par.master_port, self.beater.endpoint, cfg.join_timeout_s)  # fmt: skip

    def _node_0_lost(self, why: str, source: str = "the heartbeats") -> bool:
        """The heartbeat thread: node 0 fell silent. A node whose independent replicas all run on it alone needs
        nothing of node 0 to serve (its worlds are formed; each replica's fate is its own): node 0's replicas are
        lost, and this node's serve on. Any other node stops, and so does one still starting (its worlds form on
        node 0's store): node 0 is their hub. True: this node serves on."""
        if not self.outlives_node_0 or self.ready_count < self.replicas:
            logger.error("node %d: leader lost: %s", self.node, why)
            self.policy.report(source, LeaderLost(self.node, why))
            return False
        gone = self.par.replicas_of_node(0)
        self.node_0_lost = why
        self.beater.alone_epochs = dict(self.replica_epochs.epochs)  # (what a node 0 started again resumes from)
        logger.error(
            "node %d: node 0 was lost (%s): DP replica(s) %s with it; this node's replica(s) %s serve on without "
            "node 0 (no replacement is admitted until node 0 is started again; `rayfree status --ask` a replica's "
            "leader for its view)", self.node, why, gone, self.par.node_replicas,
        )  # fmt: skip
        self.policy.report(source, NodeLost(0, self.par.node_ranks(0), self.par.master_addr, why, gone))
        self._open_desk()
        return True

    def _open_desk(self) -> None:
        """A replica leader serving on without node 0 answers `rayfree status --ask` (cluster/status_desk.py),
        but not on node 0's own address (a node 0 started there needs that port)."""
        if not self.par.leads(self.node) or is_local_address(self.par.master_addr):
            return
        refusal = (f"refused: node 0 is lost ({self.node_0_lost}); node {self.node} serves on without it and "
                   f"decides nothing for the cluster: start node 0 again, then ask it")  # fmt: skip
        with self._desk_lock:  # (the node may be closing on another thread)
            if self._desk is None and not self._closing:
                self._desk = StatusDesk.open(self.ip, self.config.heartbeat_endpoint_port, self.node,
                                             lambda: encode(cluster_status(self)), refusal)  # fmt: skip

    def _close_desk(self, why: str = "") -> None:
        with self._desk_lock:
            desk, self._desk = self._desk, None
        if desk is not None:
            desk.stop()
            if why:
                logger.info("node %d: no longer answers `rayfree status --ask`: %s", self.node, why)

    def _close(self, bye: Bye | None) -> None:
        with self._desk_lock:
            self._closing = True
        super()._close(bye)
        self._close_desk()

    def _watched_lost(self, node: int, why: str) -> None:
        """The watch's or the heartbeat thread, node 0 lost: a node of this node's replica (a child it watches, or
        its own watcher) is lost, and nobody else will say so: its replica is lost, decided here."""
        why = f"{why}; node 0 is lost, so node {self.node}'s watch decided"
        for k in self.par.replicas_of_node(node):
            self.policy.report("the watch", ReplicaLost(k, node, self.par.node_ranks(node), why))

    def _node_0_back(self, msg: Resumed) -> None:
        """The heartbeat thread: a node 0 started again took this node back. Node 0's replicas serve again in the
        epochs it says, and this node follows node 0 again (its loss, its goodbye) as before it was lost."""
        back = self.par.replicas_of_node(0)
        logger.warning(
            "node %d: node 0 is back and leads the cluster again: DP replica(s) %s serve again (epoch(s) %s); this "
            "node follows it again", self.node, back, [msg.epochs.get(k, 0) for k in back],
        )  # fmt: skip
        self.node_0_lost = ""
        self._close_desk("node 0 is back and answers for the cluster")
        send, soon, mine = self.replica_epochs.send, self.policy.sup.call_soon, set(self.par.node_replicas)
        known, out = self.replica_epochs.epochs, {m.dp_rank for m in msg.lost}
        for m in msg.lost:  # (lost meanwhile: this node heard nothing of them while it served alone)
            if m.dp_rank not in mine:
                self._replica_down(m)
        for k, e in sorted(msg.epochs.items()):  # (node 0's replicas, and any that rejoined meanwhile)
            if k not in mine and k not in out and (k in back or e > known.get(k, 0)):
                soon(send, Back(k, e))
        if msg.requested:
            soon(send, WidthHeard(msg.requested))

    def _head_bye(self, node: int, clean: bool, reason: str) -> bool:
        """Node 0's goodbye, or, node 0 lost, this node's watcher's clean one (its replica stopped cleanly)."""
        if not clean:  # (node 0 failed as a whole: lost, to this node, as if it fell silent)
            return self._node_0_lost(f"it stopped after a failure: {reason}", "node 0's goodbye")
        what = "the cluster" if node == 0 else f"its replica (node 0 lost, node {node} watches this node)"
        logger.info("node %d: node %d stopped %s; stopping this node's workers", self.node, node, what)
        self.policy.sup.call_soon(self._stopped_by_node_0, reason or f"node {node} stopped")  # (before the report)
        self.policy.report(f"node {node}'s goodbye", None)
        return False

    def _stopped_by_node_0(self, why: str) -> None:
        """The policy thread, the one writer of `stopped_cleanly`: node 0 stopped the cluster."""
        self.stopped_cleanly = why
        self.settled.set()

    def _replica_down(self, msg: ReplicaDown) -> None:
        self.policy.report("node 0", cause_of(msg))

    def welcome_epochs(self, timeout: float) -> dict[int, int]:
        """Independent replicas: the epoch of each replica this node runs, from node 0's first answer (a node
        that replaces a lost one rejoins in a later epoch); {} if node 0 fails or stays silent meanwhile."""
        deadline = time.monotonic() + timeout
        while not self.beater.welcomed.wait(FINISH_POLL_S):
            if self.settled.is_set() or time.monotonic() > deadline:
                return {}
        if self.beater.refused is not None:
            raise ConfigError(self.beater.refused)
        welcome = self.beater.welcome
        assert welcome is not None
        self.replica_epochs.send(Welcomed(tuple(welcome.epochs.items()), welcome.requested))
        mine = set(self.par.node_replicas)
        for msg in welcome.lost:  # (lost before this node started: it knows them as the others do)
            if msg.dp_rank not in mine:
                self._replica_down(msg)
        return {k: e for k, e in welcome.epochs.items() if k in mine}

    def peer_verdict(self, grace: float | None = None) -> str:
        return "" if self.node_0_lost else follower_verdict(self.beater)

    def finish(self) -> bool:
        """Report `done` in the beats and wait for node 0's goodbye (bounded: its silence is a loss); with node 0
        lost and this node serving on, nobody is left to wait for: the nodes it watches hear its clean goodbye
        (as they would node 0's) before its workers stop, and stop theirs."""
        self.beater.done = True
        while not self.settled.wait(FINISH_POLL_S):
            if self.node_0_lost:
                self.beater.stop()
                break
        return self.failure is None
