"""Draining an independent DP replica (`rayfree drain K`): taken out of service on purpose, then brought back.

Node 0 checks the request and tells every node (`DrainReplica`). Each marks the
replica "draining" and runs the replica callbacks, so an engine routing by
`replica_states()` sends it nothing new; the node that leads the replica waits
until its calls in flight have returned (bounded by RAYFREE_DRAIN_TIMEOUT_S),
then the policy stops the replica with `ReplicaDrained` (later calls are
refused with it) and its nodes, left with no replica, stop cleanly and exit 0.
The other nodes hear of it as of a loss, which they already know for a drain.
Started again with the same command, the nodes rejoin like a lost replica's
(rejoin.py). Node 0 cannot be drained away: it leads the cluster.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rayfree import settings
from rayfree.cluster.heartbeat_messages import DrainReplica
from rayfree.supervisor import Failure, Severity

from .abstract import ReplicaState
from .errors import ReplicaDrained

__all__ = ["request", "begin", "refuse_if_draining"]

logger = logging.getLogger("rayfree.executor")

#: how often the replica's leader looks whether its calls in flight have returned
_POLL_S = 0.05


def request(lv: Any, k: int) -> str:
    """Node 0 (the heartbeat thread): `rayfree drain k`. Starts the drain and says so, or says why not."""
    par, ep = lv.par, lv.replica_epochs
    dp = par.data_parallel_size
    if dp == 1 or par.one_world:
        return "refused: only DP replicas with worlds of their own drain (" + (
            "this cluster has one replica)" if dp == 1 else "these share one world: replica_coupling=one-world)"
        )
    if not 0 <= k < dp:
        return f"refused: there is no DP replica {k} (replicas 0-{dp - 1})"
    state = ep.states()[k].state
    if state != "serving":
        return f"refused: DP replica {k} is {state}, not serving"
    if all(r == k or r in lv.policy.lost or r in ep.draining for r in par.node_replicas):
        return f"refused: DP replica {k} is the last one node 0 serves, and node 0 leads the cluster: it cannot stop"
    ep.draining.add(k)  # (a second request now is refused: the rest runs on the policy thread)
    lv.policy.sup.call_later(0.0, begin, lv, k)
    if lv.beater is not None and par.nnodes > 1:
        lv.beater.tell(list(range(1, par.nnodes)), DrainReplica(k))
    nodes = par.nodes_of_replica(k)
    logger.warning("node 0: DP replica %d drains on the operator's request (nodes %s)", k, nodes)
    return (
        f"DP replica {k} drains: its calls in flight finish, then node(s) {nodes} stop and exit 0. Start them "
        f"again with the same command to bring it back"
    )


def refuse_if_draining(ex: Any) -> None:
    """A call to a replica that drains is refused at once (`ReplicaDrained`): it takes no new calls."""
    lv = ex.liveness
    if lv is not None and ex.dp_rank in lv.replica_epochs.draining and not ex.is_failed:  # (drained: its own word)
        par = ex.parallel_config
        why = "it drains on the operator's request and takes no new calls; its calls in flight finish"
        raise ReplicaDrained(ex.dp_rank, par.node_rank, par.node_ranks(par.node_rank), why)


def begin(lv: Any, k: int) -> None:
    """Every node (the policy thread): replica k drains; the node leading it waits for its calls in flight."""
    ep = lv.replica_epochs
    if k in lv.policy.lost:
        return  # lost meanwhile: nothing left to drain
    ep.draining.add(k)
    state = ReplicaState("draining", ep.epochs.get(k, 0), "drained by the operator")
    for ex in lv.executors():
        ex.fire_replica_callbacks(k, state)
    until = time.monotonic() + float(settings.get("RAYFREE_DRAIN_TIMEOUT_S"))
    for ex in lv.executors():
        if ex.dp_rank == k and ex.is_leader:
            _wait(lv, ex, until)


def _wait(lv: Any, ex: Any, until: float) -> None:
    snap = ex.rpc_snapshot()
    busy = [c[0] for c in snap.calls] if snap is not None else []
    if busy and time.monotonic() < until:
        lv.policy.sup.call_later(_POLL_S, _wait, lv, ex, until)
        return
    why = "drained by the operator"
    if busy:
        why += f"; call(s) {busy} still in flight after RAYFREE_DRAIN_TIMEOUT_S were cut short"
        logger.warning("DP replica %d: %s", ex.dp_rank, why)
    par = lv.par
    ranks = [r for r in par.node_ranks(lv.node) if r // par.world_size == ex.dp_rank]
    lv.policy.apply(Failure("the drain", ReplicaDrained(ex.dp_rank, lv.node, ranks, why), Severity.WORKER, lv.policy,
                            ex))  # fmt: skip
