"""Cluster-wide liveness: one node's part, shared by the executors (DP replicas) that node runs.

Node 0 runs the heartbeat server and every other node beats toward it, so a
lost node is noticed in one place and every replica hears of it: with data
parallelism the ranks of all replicas share collectives (expert parallelism,
the DP all-reduce), and one replica carrying on alone would hang in them.

The policy, in one place:
- a node lost, or stopping after a failure: node 0 fails its executors, naming
  the node, its replica(s) and ranks, and says `Bye(failed)` to every other
  node, which fails its own;
- an executor of this node fails: the node's other replicas fail with it and
  the node says so (node 0 to everyone, another node to node 0);
- a clean stop: each replica leader's entry point returns and its node calls
  `finish()`; other nodes report `done` in their beats, node 0 waits for every
  replica leader's, then stops and says `Bye(clean)`, and every node stops.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.heartbeat import Bye, HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.transport import get_ip
from rayfree.transport.net import bind_address

from .errors import LeaderLost, NodeLost, ReplicaFailed
from .status import (
    ClusterStatus,
    NodeStatus,
    RelayStatus,
    decode_node,
    encode,
    relay_status,
    replica_status,
    worker_statuses,
)
from .view import ReplicaView

__all__ = ["NodeLiveness"]

logger = logging.getLogger("rayfree.executor")

#: How long node 0 that refuses to start waits for followers to beat, to tell them why (`refuse`).
REFUSE_TELL_S = 5.0
#: How often `finish()` on node 0 looks at the other replica leaders' `done`.
_FINISH_POLL_S = 0.05


class NodeLiveness:
    """This node's heartbeats (none on a one-node cluster) and the failure policy above, for `replicas`
    executors; `attach` each as it starts."""

    def __init__(self, config: ClusterConfig, replicas: int = 1) -> None:
        self.config = config
        self.par = par = config.parallel
        self.node = par.node_rank
        self.replicas = replicas
        self._lock = threading.Lock()
        self._executors: list[weakref.ref[ReplicaView]] = []
        self._ready = 0
        self._stopped = 0
        self._closed = False
        self.failure: Exception | None = None
        #: set when the operator stops this node (SIGTERM, Ctrl-C): its stop is a clean one for the cluster,
        #: even if it cut a call short (what the other nodes are told, e.g. "SIGTERM on node 0")
        self.stop_requested = ""
        #: the executors record each call's latency (someone serves metrics); set before they start
        self.histograms = False
        #: set when the cluster's fate is decided: node 0 said goodbye, or something failed
        self.settled = threading.Event()
        self.beater: HeartbeatServer | HeartbeatClient | None = None
        self.ip = get_ip(peer=par.master_addr) if par.nnodes > 1 else "127.0.0.1"
        if par.nnodes > 1:
            self.beater = self._server() if self.node == 0 else self._client()
            # Node 0 answers `rayfree status`; the others send their status with every beat.
            self.beater.status_fn = (
                (lambda: encode(self.cluster_status())) if self.node == 0 else (lambda: encode(self.node_status()))
            )
            if isinstance(self.beater, HeartbeatServer):
                from .health import ready

                self.beater.verdict_fn = lambda: ready(self)

    # -- heartbeats ------------------------------------------------------------------

    def _server(self) -> HeartbeatServer:
        par, cfg = self.par, self.config
        others = {k: par.node_ranks(k) for k in range(1, par.nnodes)}
        server = HeartbeatServer(
            bind_address(par.master_addr),
            cfg.heartbeat_endpoint_port,
            others,
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            self._node_lost,
            cfg.join_timeout_s,
        )
        logger.info(
            "node 0: heartbeat endpoint %s; waiting for %d other node(s) to join (join_timeout_s=%.0f)",
            server.endpoint,
            len(others),
            cfg.join_timeout_s,
        )
        return server

    def refuse(self, reason: str, tell_s: float = REFUSE_TELL_S) -> None:
        """Node 0 refuses to start (say, its master port is taken): tell every follower that beats within
        `tell_s` (followers started with it are still importing), so none waits for its join timeout; then
        close, as soon as every follower was told."""
        self.failure = RuntimeError(reason)
        self.settled.set()
        if isinstance(self.beater, HeartbeatServer):
            self.beater.tell_late_s = tell_s
        self._close(Bye(self.node, False, reason[:300]))

    def _client(self) -> HeartbeatClient:
        par, cfg = self.par, self.config
        client = HeartbeatClient(
            par.master_addr,
            cfg.heartbeat_endpoint_port,
            self.node,
            par.node_ranks(self.node),
            get_ip(peer=par.master_addr),
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            lambda why: self._fail_soon(LeaderLost(self.node, why)),
            self._head_bye,
        )
        logger.info(
            "node %d: waiting for node 0 at %s:%d (heartbeats at %s) to form the world (join_timeout_s=%.0f)",
            self.node,
            par.master_addr,
            par.master_port,
            client.endpoint,
            cfg.join_timeout_s,
        )
        return client

    def _node_lost(self, node: int, ranks: list[int], ip: str, why: str) -> None:
        replicas = self.par.replicas_of_node(node) if self.par.data_parallel_size > 1 else None
        self._fail_soon(NodeLost(node, ranks, ip, why, replicas))

    def _fail_soon(self, error: Exception) -> None:
        """`fail_all` off the heartbeat thread, which must be free to say goodbye to the other nodes at once
        (the executors' staged close takes a while)."""
        threading.Thread(target=self.fail_all, args=(error,), daemon=True, name="RayfreeNodeFailed").start()

    def _head_bye(self, _node: int, clean: bool, reason: str) -> None:
        if clean:
            logger.info("node %d: node 0 stopped the cluster; stopping this node's workers", self.node)
            self.settled.set()
            for ex in self.executors():
                ex.shutdown()
        else:
            self._fail_soon(LeaderLost(self.node, f"it stopped after a failure: {reason}"))

    def verdict_s(self) -> float:
        """How long the heartbeats take at most to call a node whose processes died lost (0: one node)."""
        b = self.beater
        return 0.0 if b is None else b.suspect_window + b.interval + 0.3

    # -- the executors ---------------------------------------------------------------------

    def attach(self, ex: ReplicaView) -> None:
        if self.histograms:
            ex.record_latencies()
        with self._lock:
            self._executors.append(weakref.ref(ex))
            failure = self.failure
        if failure is not None:
            # The node failed before this executor attached (node 0 refused to start, or said goodbye, while
            # this node was still starting): `fail_all` did not see it, so it starts no workers at all.
            raise failure

    def executors(self) -> list[ReplicaView]:
        with self._lock:
            return [x for x in (r() for r in self._executors) if x is not None]

    @property
    def ready_count(self) -> int:
        """How many of this node's executors are ready."""
        return self._ready

    def ready(self) -> None:
        """One executor is ready; once all of this node's are, silence counts as a loss."""
        with self._lock:
            self._ready += 1
            arm = self._ready == self.replicas
        if arm and self.beater is not None:
            self.beater.arm()

    def fail_all(self, error: Exception) -> None:
        """Fail every executor of this node with `error` (each then stops, see `stopped`)."""
        with self._lock:
            if self.failure is None:
                self.failure = error
        self.settled.set()
        self._fail_each(error)

    def _fail_each(self, error: Exception, but: ReplicaView | None = None) -> None:
        for ex in self.executors():
            if ex is not but:
                ex.fail(error)  # at once: peers may hang in gloo, so do not wait long for them

    def stopped(self, ex: ReplicaView, failure: Exception | None, reason: str) -> None:
        """Executor `ex` is shutting down (before its workers stop); tell whoever must know."""
        if self.stop_requested and (failure is None or not isinstance(failure, (NodeLost, LeaderLost))):
            failure, reason = None, ""  # stopped on purpose: the others stop cleanly too
        if failure is not None or reason:
            why = reason or str(failure).split("\n")[0]
            with self._lock:
                first = self.failure is None
                if first:
                    self.failure = failure or ReplicaFailed(ex.dp_rank, why)
            if first:  # this node's other replicas share collectives with it
                self._fail_each(ReplicaFailed(ex.dp_rank, why), but=ex)
            self.settled.set()
            self._close(Bye(self.node, False, why[:300]))
            return
        with self._lock:
            self._stopped += 1
            last = self._stopped >= len(self._executors)
        if last:
            self._close(
                Bye(
                    self.node,
                    True,
                    f"stopped on request ({self.stop_requested})" if self.stop_requested else "shut down",
                )
            )

    def _close(self, bye: Bye) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.beater is not None:  # the other side(s) stop too, without waiting for a timeout
            self.beater.close(bye)

    # -- what `rayfree status` shows -------------------------------------------------------------

    def node_status(self) -> NodeStatus:
        """This node: its workers, and the replicas it leads (calls in flight, replies, the ring)."""
        par = self.par
        exs = self.executors()
        rtt = self.beater.rtt_s if isinstance(self.beater, HeartbeatClient) else None
        return NodeStatus(
            node=self.node,
            ip=self.ip,
            pid=os.getpid(),
            ranks=par.node_ranks(self.node),
            replicas=par.node_replicas,
            workers=[w for ex in exs for w in worker_statuses(ex)],
            leads=[replica_status(ex) for ex in exs if ex.is_leader],
            heartbeat_rtt_ms=None if rtt is None else round(rtt * 1000, 3),
            relays=[r for r in (relay_status(ex) for ex in exs) if r is not None],
            state="failed" if self.failure is not None else "ok",
        )

    def relays_seen(self) -> dict[int, list[RelayStatus]]:
        """Node 0: each follower's relays, from its last heartbeat's status, by node (for the stall report)."""
        out: dict[int, list[RelayStatus]] = {}
        if isinstance(self.beater, HeartbeatServer):
            for node, _ip, _ranks, _age, _gone, raw in self.beater.peer_views():
                try:
                    out[node] = decode_node(raw).relays if raw else []
                except Exception:  # noqa: BLE001 - an unreadable status: nothing to say of its relay
                    out[node] = []
        return out

    def cluster_status(self) -> ClusterStatus:
        """Every node (node 0's view: the others' last reported status and the age of their last beat)."""
        from rayfree.cluster.join import shape_of

        par = self.par
        nodes = [self.node_status()]
        if isinstance(self.beater, HeartbeatServer):
            for node, ip, ranks, age, gone, raw in self.beater.peer_views():
                ns = None
                if raw:
                    try:
                        ns = decode_node(raw)
                    except Exception:  # noqa: BLE001 - an unreadable status: show what the heartbeats know
                        ns = None
                if ns is None:
                    ns = NodeStatus(node=node, ip=ip, pid=-1, ranks=ranks, replicas=par.replicas_of_node(node))
                ns.heartbeat_age_s = None if age is None else round(age, 3)
                ns.state = "lost" if gone else ("not joined" if age is None else ns.state)
                nodes.append(ns)
        return ClusterStatus(
            nnodes=par.nnodes,
            world_size=par.world_size,
            data_parallel_size=par.data_parallel_size,
            shape=shape_of(par),
            nodes=nodes,
        )

    # -- a clean stop ---------------------------------------------------------------------

    def finish(self) -> bool:
        """This node's entry points have returned: wait until the whole cluster may stop (True), or it
        failed (False). Node 0 waits for every other replica leader; another node, for node 0's goodbye."""
        if self.beater is None:
            return self.failure is None
        if isinstance(self.beater, HeartbeatClient):
            self.beater.done = True
            self.settled.wait()  # bounded: node 0's goodbye, or its silence (heartbeat_timeout_s)
            return self.failure is None
        leaders = [k for k in range(1, self.par.nnodes) if self.par.leads(k)]
        if leaders:
            logger.info(
                "node 0: this node's replicas are done; waiting for the replica leader(s) on node(s) %s", leaders
            )
        while not self.settled.wait(_FINISH_POLL_S):
            if self.beater.all_done(leaders):
                return True
        return self.failure is None
