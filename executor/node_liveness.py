"""Cluster-wide liveness: one node's part, shared by the executors (DP replicas) that node runs, in two roles.

Node 0 (`LeaderLiveness`) runs the heartbeat server and every other node (`FollowerLiveness`,
follower_liveness.py) beats toward it, so a lost node is noticed in one place and every replica hears of it:
with data parallelism the ranks of all replicas share collectives (expert parallelism, the DP all-reduce),
and one replica carrying on alone would hang in them. Independent replicas that each run on one node are the
exception: they need nothing of node 0 once they run, and outlive it. What a failure means is the node's
policy's (failure_policy.py); the heartbeats only report to it, and this module says goodbye to the other
nodes when the policy decides the node stops:

- the node failed (a node lost, a worker, a replica): `Bye(failed)` to every
  other node (node 0), or to node 0 (a follower), and they fail too;
- every executor of the node stopped cleanly: `Bye(clean)`; a clean stop of the
  whole cluster waits for every replica leader: each leader's node reports
  `done` once its entry points returned (`finish`), node 0 waits for all of
  them, stops, and says `Bye(clean)`, and every node stops.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.heartbeat import Bye, HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.supervisor import Failure, Severity
from rayfree.transport import get_ip

from . import drain
from .errors import LeaderLost, NodeLost, ReplicaFailed
from .failure_policy import NodePolicy, why_of
from .rejoin import Rejoins, ReplicaEpochs
from .roles import PolicyExecutor

__all__ = ["NodeLiveness", "FINISH_POLL_S", "REFUSE_TELL_S", "WHY_CHARS"]

logger = logging.getLogger("rayfree.executor")

#: How often `finish()` on node 0 looks at the other replica leaders' `done`.
FINISH_POLL_S = 0.05
#: How long node 0 that refuses to start waits for followers to beat, to tell them why (`refuse`).
REFUSE_TELL_S = 5.0
#: how much of a failure a goodbye carries (a join's disagreement names both sides: about 500 characters)
WHY_CHARS = 1000
#: How often the policy looks whether the heartbeat thread has ended (`close_steps`), and for how long at most.
_CLOSE_POLL_S = 0.02
_CLOSE_WAIT_S = 10.0


class NodeLiveness:
    """This node's heartbeats (none on a one-node cluster) and its failure policy, for `replicas` executors
    (`attach` each as it starts). liveness.py's `for_node` gives the role: node 0's or a follower's."""

    beater: HeartbeatServer | HeartbeatClient | None = None

    def __init__(self, config: ClusterConfig, replicas: int = 1, owner: Any = None) -> None:
        if type(self) is NodeLiveness:
            raise TypeError("a node's liveness has a role: make it with rayfree.executor.liveness.for_node(config)")
        self.config = config
        self.par = par = config.parallel
        self.node = par.node_rank
        self.replicas = replicas
        self._owner = None if owner is None else weakref.ref(owner)
        self.policy = NodePolicy(self)
        self._lock = threading.Lock()
        self._executors: list[weakref.ref[PolicyExecutor]] = []
        self._ready = 0
        self._stopped = 0
        self._closed = False
        #: set when the operator stops this node (SIGTERM, Ctrl-C): its stop is a clean one for the cluster,
        #: even if it cut a call short (what the other nodes are told, e.g. "SIGTERM on node 0")
        self.stop_requested = ""
        #: the executors record each call's latency (someone serves metrics); set before they start
        self.histograms = False
        #: set when the cluster's fate is decided: node 0 said goodbye, or something failed
        self.settled = threading.Event()
        #: node 0 stopped the cluster cleanly (its goodbye, on a follower): why, or "" while it has not
        self.stopped_cleanly = ""
        self.ip = get_ip(peer=par.master_addr) if par.nnodes > 1 else "127.0.0.1"
        self._refused = ""
        #: every DP replica's epoch and state (node 0: and its admission of replacements)
        self.replica_epochs = (Rejoins if self.node == 0 else ReplicaEpochs)(self)
        self.independent = par.data_parallel_size > 1 and not par.one_world
        #: coupled DP replicas: the membership epoch and the replicas in it (membership.py; node 0 declares each)
        self.membership: tuple[int, list[int]] = (0, list(range(par.data_parallel_size)))

    @property
    def owner(self) -> Any:
        """The executor that made this liveness for itself (its heartbeats end with it), or None (NodeReplicas')."""
        return None if self._owner is None else self._owner()

    @property
    def failure(self) -> Exception | None:
        """The node's failure, as its policy recorded it (None while it runs)."""
        if self._refused:
            return RuntimeError(self._refused)
        record = self.policy.record
        return None if record is None else record.cause

    def verdict_s(self) -> float:
        """How long the heartbeats take at most to call a node whose processes died lost (0: one node)."""
        b = self.beater
        return 0.0 if b is None else b.suspect_window + b.interval + 0.3

    def peer_verdict(self, grace: float | None = None) -> str:
        """What the heartbeats say of the other nodes' readiness ("" ready); see health.ready."""
        return ""

    # -- the executors ---------------------------------------------------------------------

    def attach(self, ex: PolicyExecutor) -> None:
        if self.histograms:
            ex.record_latencies()
        with self._lock:
            self._executors.append(weakref.ref(ex))
            failure = self.failure
        if failure is not None:
            # The node failed before this executor attached (node 0 refused to start, or said goodbye, while
            # this node was still starting): `fail_all` did not see it, so it starts no workers at all.
            raise failure

    def executors(self) -> list[PolicyExecutor]:
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

    def nodes(self) -> list[int]:
        """The cluster's nodes as this node knows them (node 0's: also those a scale-out past --dp added)."""
        return list(range(self.par.nnodes))

    def lost_nodes(self) -> set[int]:
        """The nodes whose every replica is lost: no longer part of the cluster's readiness."""
        lost = self.policy.lost
        return {k for k in self.nodes() if lost and all(r in lost for r in self.par.replicas_of_node(k))}

    def scale(self, width: int) -> str:
        """Node 0: ask for `width` DP replicas (drain.py's `scale`): one line."""
        return drain.scale(self, width)

    def welcome_epochs(self, timeout: float) -> dict[int, int]:
        """(A follower's: node 0 says which epoch each of its replicas starts in.)"""
        return {}

    def fail_all(self, error: Exception) -> None:
        """Report a failure of the whole node (any thread): its policy fails every executor with `error`, FATAL
        whatever the error's own type weighs."""
        self.policy.sup.post(Failure("this node", error, Severity.FATAL, self.policy))

    # -- what the policy tells it (the policy thread) -------------------------------------------------------

    def failed(self, f: Failure) -> None:
        """The node failed: say so to the other side(s), who stop too, without waiting for a timeout."""
        if isinstance(f.cause, LeaderLost):
            self._close(None)  # node 0 is gone or said goodbye: nobody to tell
            return
        self._close(Bye(self.node, False, why_of(f.cause)[:WHY_CHARS]))

    def stopping(self, ex: PolicyExecutor) -> None:
        """Executor `ex` begins its shutdown. A clean one counts toward the node's clean goodbye; one with a
        reason to stop (its entry point raised) fails the node's other replicas and the cluster."""
        reason = ex.stop_reason or ""
        failure = ex.failure
        if (self.stop_requested or self.stopped_cleanly) and not isinstance(failure, (NodeLost, LeaderLost)):
            failure, reason = None, ""  # stopped on purpose (here, or by node 0): the others stop cleanly too
        lost = self.policy.lost
        if ex.dp_rank in lost:
            failure, reason = None, ""  # an independent replica lost: not the node's failure, and not running
        if failure is not None or reason:
            if self.policy.record is None:  # (an interrupted call, an entry that raised, a failed start-up)
                why = reason or why_of(failure)
                cause = failure or ReplicaFailed(ex.dp_rank, why)
                # (the node's failure whatever the cause's own weight: an interrupted call included)
                self.policy.apply(Failure(f"DP replica {ex.dp_rank}", cause, Severity.FATAL, self.policy, ex))
            return
        with self._lock:
            self._stopped += 1
            last = self._stopped >= len(self._executors)
        drained = last and self.policy.drained_only()
        if ex.dp_rank in lost and not drained:
            return  # (counted: once the node's other replicas stop cleanly, its goodbye is a clean one)
        if last:
            why = f"stopped on request ({self.stop_requested})" if self.stop_requested else (
                f"its DP replica(s) {self.par.node_replicas} were drained" if drained else "shut down"
            )  # fmt: skip
            self._close(Bye(self.node, True, why))

    def _close(self, bye: Bye | None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.beater is not None:  # the other side(s) stop too, without waiting for a timeout
            self.beater.stop(bye)

    def close_steps(self) -> Iterator[float]:
        """Until the heartbeat thread has said its goodbye and ended (bounded): the policy's steps."""
        self._close(None)
        waited = 0.0
        while self.beater is not None and self.beater.running() and waited < _CLOSE_WAIT_S:
            waited += _CLOSE_POLL_S
            yield _CLOSE_POLL_S

    def close(self, timeout: float = _CLOSE_WAIT_S) -> None:
        """The heartbeats end (from a thread that is not theirs): a node's last step."""
        self._close(None)
        if self.beater is not None:
            self.beater.join(timeout)

    def finish(self) -> bool:
        """This node's entry points have returned: wait until the whole cluster may stop (True), or it failed."""
        raise NotImplementedError

    def refuse(self, reason: str, tell_s: float = REFUSE_TELL_S) -> None:
        """Node 0 refuses to start (say, its master port is taken): tell every follower that beats within
        `tell_s` (followers started with it are still importing), so none waits for its join timeout; then
        close, as soon as every follower was told."""
        self._refused = reason
        self.settled.set()
        if isinstance(self.beater, HeartbeatServer):
            self.beater.tell_late_s = tell_s
        self._close(Bye(self.node, False, reason[:WHY_CHARS]))
        self.close(tell_s + 5.0)
