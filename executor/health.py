"""What the health probes answer: is this node up (`alive`), and is the whole cluster able to serve (`ready`).

Both return "" for yes, else one line saying why not, so a probe's 503 names
the node, rank or call at fault. Node 0 judges the cluster from what it has
anyway: its own workers' process states, every follower's heartbeat age and
last status, the calls in flight; a follower answers with its own workers,
its last answer from node 0, and node 0's verdict, which node 0 pushes to it
over the heartbeat channel the moment it changes. With independent DP
replicas each replica is judged alone: node 0 is ready while
RAYFREE_MIN_SERVING_REPLICAS of them serve, and a follower hears the verdict
on its own replicas. A follower whose connection dropped counts as not ready
at once (a killed node's kernel closes it), well before the heartbeats
declare it lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rayfree import settings
from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.procs import proc_state

from .status_messages import decode_node

#: a NodeLiveness (liveness.py imports this module, so it is not imported back)
NodeLiveness = Any

__all__ = ["alive", "ready", "suspect", "followers_verdict", "follower_verdict", "verdicts", "replica_verdicts"]

#: process states that mean a rank cannot answer
_DOWN = ("gone", "a zombie", "stopped")


def _line(error: object) -> str:
    return str(error).split("\n")[0][:300]


def _workers(lv: NodeLiveness, down: tuple[str, ...] = _DOWN, only: int | None = None) -> str:
    for ex in lv.executors():
        if ex.stopped or ex.dp_rank in lv.policy.lost or only not in (None, ex.dp_rank):
            continue
        for w in ex.workers:
            pid = w.proc.pid
            state = proc_state(pid) if pid else "not started"
            if state.startswith(down):
                rank = ex.parallel_config.global_rank(w.rank, ex.dp_rank)
                return f"node {lv.node}: rank {rank} (pid {pid}) is {state}"
    return ""


def alive(lv: NodeLiveness | None) -> str:
    """Is this node's process up and able to look after itself ("" yes)? A failing probe is a kubelet's order
    to kill and restart, so only what the node cannot mend by itself fails it: a worker stopped (SIGSTOP, a
    debugger) while nothing failed. Start-up counts as alive, and so does a failed cluster: the node stops its
    workers and exits non-zero on its own within about two seconds (`/readyz` says why meanwhile); a worker that
    died is noticed by the node at once."""
    if lv is None or lv.failure is not None or lv.settled.is_set() or lv.stop_requested:
        return ""
    return _workers(lv, down=("stopped",))


def _stalled(lv: NodeLiveness, only: int | None = None) -> str:
    bound = lv.config.stall_report_s
    for ex in lv.executors():
        if only not in (None, ex.dp_rank):
            continue
        snap = None if ex.stopped else ex.rpc_snapshot()
        for method, age, waiting, _start in snap.calls if snap is not None else []:
            if age > bound:
                return f"call {method} has waited {age:.1f}s (stall_report_s={bound:g}) for rank(s) {waiting}" + (
                    f" of DP replica {ex.dp_rank}" if lv.par.data_parallel_size > 1 else ""
                )
    return ""


def followers_verdict(server: HeartbeatServer, grace: float | None = None, skip: set[int] | None = None) -> str:
    """Node 0's view of its followers' readiness ("" ready): lost, not joined, silent, a dropped connection not
    beaten since (after `grace`, default a beat and a bit), a node or rank it reported down. The nodes in
    `skip` (of independent DP replicas lost) no longer count."""
    now = time.monotonic()
    fresh = server.suspect_window + 2 * server.interval
    dropped = server.suspect_at
    for node, ip, _ranks, age, gone, raw in server.peer_views():
        if skip and node in skip:
            continue
        if gone:
            return f"node {node} ({ip}) is lost"
        if age is None:
            return f"node {node} has not joined yet"
        if age > fresh:
            return f"node {node} ({ip}): no heartbeat for {age:.1f}s"
        wait = server.interval + 0.15 if grace is None else grace
        if dropped is not None and now - age < dropped and now - dropped >= wait:
            return f"node {node} ({ip}): its connection dropped {now - dropped:.1f}s ago and it has not beaten since"
        if raw:
            try:
                status = decode_node(raw)
            except Exception:  # noqa: BLE001 - an unreadable status: the heartbeats above still judge
                continue
            if status.state != "ok":
                return f"node {node} ({ip}) is {status.state}"
            down = [w for w in status.workers if w.state.startswith(_DOWN)]
            if down:
                return f"node {node}: rank {down[0].global_rank} (pid {down[0].pid}) is {down[0].state}"
    return ""


def _node_state(lv: NodeLiveness | None) -> str:
    if lv is None:
        return "starting: the node's workers are not started yet"
    if lv.failure is not None:
        return f"the cluster failed: {_line(lv.failure)}"
    if lv.stop_requested or lv.settled.is_set():
        return "the cluster is stopping" + (f" ({lv.stop_requested})" if lv.stop_requested else "")
    if lv.ready_count < lv.replicas:
        return f"starting: {lv.ready_count} of {lv.replicas} replica(s) on node {lv.node} ready"
    return ""


def ready(lv: NodeLiveness | None) -> str:
    """The cluster can serve ("" yes): every rank alive, every heartbeat fresh, no call stalled; with independent
    DP replicas, on node 0, at least RAYFREE_MIN_SERVING_REPLICAS replicas so."""
    why = _node_state(lv)
    if why:
        return why
    if lv.node == 0 and lv.independent:
        return _enough(replica_verdicts(lv))
    return _ranks(lv, lv.peer_verdict) or _stalled(lv) or lv.peer_verdict()


def _ranks(lv: NodeLiveness, peers: Callable[[float | None], str], only: int | None = None) -> str:
    """A rank of this node down ("" none), after what `peers` says at once of the other nodes: a rank that left
    because a peer went away (its collective's link reset) is gone before the heartbeats call that peer's node
    lost, and a follower's dropped connection is the likelier cause, so it comes first."""
    local = _workers(lv, only=only)
    if not local:
        return ""
    peer = peers(0.0)
    return f"{peer}; {local}" if peer else local


def replica_verdicts(lv: NodeLiveness) -> dict[int, str]:
    """Node 0, independent DP replicas: each one's readiness ("" it serves: its ranks alive, its nodes' heartbeats
    fresh, none of its calls stalled), by replica."""
    par, out = lv.par, {}
    gone, everyone = lv.lost_nodes(), set(lv.nodes())  # (once per verdict, not once per replica)
    for k, st in lv.replica_epochs.states().items():
        if st.state != "serving":
            out[k] = f"DP replica {k} is {st.state}" + (f" ({st.why})" if st.why else "")
            continue
        others = everyone - set(par.nodes_of_replica(k)) | gone

        def peers(grace: float | None, others: set[int] = others) -> str:
            return followers_verdict(lv.beater, grace, others) if lv.beater is not None else ""

        why = _ranks(lv, peers, only=k) or _stalled(lv, only=k) or peers(None)
        out[k] = f"DP replica {k}: {why}" if why else ""
    return out


def _enough(per: dict[int, str]) -> str:
    need = max(1, int(settings.get("RAYFREE_MIN_SERVING_REPLICAS")))
    serving = [k for k, why in per.items() if not why]
    if len(serving) >= need:
        return ""
    whys = "; ".join(why for why in per.values() if why)
    return f"{len(serving)} of {len(per)} DP replicas serve, fewer than {need} (RAYFREE_MIN_SERVING_REPLICAS): {whys}"


def verdicts(lv: NodeLiveness) -> dict[int, str]:
    """Node 0: what each follower's /readyz says, by node: the cluster's readiness, or with independent DP
    replicas that of the follower's own replicas."""
    nodes = lv.nodes()[1:]
    if not lv.independent:
        return dict.fromkeys(nodes, ready(lv))
    base = _node_state(lv)
    per = {} if base else replica_verdicts(lv)
    return {n: base or "; ".join(per[k] for k in lv.par.replicas_of_node(n) if per[k]) for n in nodes}


def follower_verdict(client: HeartbeatClient) -> str:
    """A follower's view of the cluster's readiness ("" ready): node 0's answers, and its pushed verdict."""
    if client.last_reply is None:
        return "node 0 has not answered yet"
    age = time.monotonic() - client.last_reply
    if age > client.suspect_window + client.interval:
        return f"no answer from node 0 for {age:.1f}s"
    if client.leader_verdict:
        return f"node 0 says: {client.leader_verdict}"
    return ""


def suspect(lv: NodeLiveness | None) -> str:
    """What looks wrong right now, before any verdict ("" nothing): for a node stopped by its launcher (srun's
    --kill-on-bad-exit) a moment after a peer died, so its last words name that peer."""
    if lv is None:
        return ""
    if lv.failure is not None:
        return _line(lv.failure)
    # a peer first (node 0's view of its followers): the launcher's signal may have reached this node's workers
    return (lv.peer_verdict(grace=0.0) if lv.node == 0 else "") or _workers(lv)
