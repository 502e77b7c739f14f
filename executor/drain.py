"""Draining a DP replica (`rayfree drain K`, `rayfree scale --dp N`): taken out of service on purpose, then
brought back.

Node 0 checks the request and tells every node (`DrainReplica`). Each marks the
replica "draining" and runs the replica callbacks, so an engine routing by
`replica_states()` sends it nothing new; the node that leads the replica waits
until its calls in flight have returned (bounded by RAYFREE_DRAIN_TIMEOUT_S),
then the policy stops the replica with `ReplicaDrained` (later calls are
refused with it) and its nodes, left with no replica, stop cleanly and exit 0.
The other nodes hear of it as of a loss, which they already know for a drain.
Started again with the same command, the nodes rejoin like a lost replica's
(rejoin.py). Node 0 cannot be drained away: it leads the cluster.

Coupled replicas step together: a step's collective across replicas ends only
when every member's does. The survivors form groups without the draining
replica before their next step (the roster declares the membership as the
drain begins), so its step in flight could wait for theirs forever, and theirs
for it: it stops at once instead, its nodes exit 0 all the same, and a
survivor's step that met it raises `ReplicasChanged`, as at a loss: the engine
runs it again over the new groups.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rayfree import settings

from .errors import ReplicaDrained
from .roster import Drain, Scale

if TYPE_CHECKING:
    from .roles import Node, PolicyExecutor

__all__ = ["request", "scale", "begin", "refuse_if_draining"]

logger = logging.getLogger("rayfree.executor")

#: how often the replica's leader looks whether its calls in flight have returned
_POLL_S = 0.05


def request(lv: Node, k: int) -> str:
    """Node 0 (the heartbeat thread): `rayfree drain k`. Starts the drain and says so, or says why not."""
    return lv.replica_epochs.send(Drain(k))[-1].text


def scale(lv: Node, width: int) -> str:
    """Node 0 (any thread): `rayfree scale --dp width`. The highest replicas drain, or replicas drained or lost
    below `width` may rejoin (their nodes started again with the same command), and replicas past those the
    cluster had come on new nodes (the cluster's command, --dp and --nnodes raised to the width). A cluster on
    one node has no heartbeat endpoint for new nodes."""
    dp = lv.par.data_parallel_size
    if width > dp >= 1 and lv.par.nnodes == 1 and not lv.par.one_world:
        return (f"refused: this cluster was laid out for {dp} DP replica(s) on one node, which new nodes cannot "
                f"join (it has no heartbeat endpoint); it scales between 1 and {dp}: start it with --nnodes 2 or "
                f"more to add nodes later")  # fmt: skip
    return str(lv.replica_epochs.send(Scale(width, time.monotonic(), lv.config.join_timeout_s))[-1].text)


def refuse_if_draining(ex: PolicyExecutor) -> None:
    """A call to a replica that drains is refused at once (`ReplicaDrained`): it takes no new calls."""
    lv = ex.liveness
    if lv is not None and lv.replica_epochs.drains(ex.dp_rank) and not ex.is_failed:  # (drained: its own word)
        par = ex.parallel_config
        why = "it drains on the operator's request and takes no new calls; its calls in flight finish"
        raise ReplicaDrained(ex.dp_rank, par.node_rank, par.node_ranks(par.node_rank), why)


def begin(lv: Node, k: int) -> None:
    """Every node running replica k (the policy thread; the roster marked it draining and told the callbacks):
    the node leading it waits for its calls in flight."""
    until = time.monotonic() + float(settings.get("RAYFREE_DRAIN_TIMEOUT_S"))
    for ex in lv.executors():
        if ex.dp_rank == k and ex.is_leader:
            _wait(lv, ex, until)


def _wait(lv: Node, ex: PolicyExecutor, until: float) -> None:
    if ex.is_failed or ex.dp_rank in lv.policy.lost:
        return  # lost meanwhile: nothing left to drain
    snap = ex.rpc_snapshot()
    busy = [c[0] for c in snap.calls] if snap is not None else []
    why = "drained by the operator"
    if busy and lv.par.coupled:  # (module docstring: a step across replicas cannot finish alone)
        why += f"; its step(s) {busy} across replicas were cut short (the other replicas run theirs again)"
    elif busy and time.monotonic() < until:
        lv.policy.sup.call_later(_POLL_S, _wait, lv, ex, until)
        return
    elif busy:
        why += f"; call(s) {busy} still in flight after RAYFREE_DRAIN_TIMEOUT_S were cut short"
        logger.warning("DP replica %d: %s", ex.dp_rank, why)
    par = lv.par
    ranks = [r for r in par.node_ranks(lv.node) if r // par.world_size == ex.dp_rank]
    lv.policy.apply(lv.policy.failure("the drain", ReplicaDrained(ex.dp_rank, lv.node, ranks, why), ex))
