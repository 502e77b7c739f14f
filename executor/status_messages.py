"""A cluster you can see into: what `rayfree status` shows, as wire messages.

Each node describes itself in a `NodeStatus` (its workers, and for each DP
replica it leads: calls in flight, time since each rank's last reply, the
broadcast ring's occupancy). Other nodes send theirs to node 0 inside their
heartbeats, so node 0 answers a status query alone, with the heartbeat age of
every node, over the authenticated heartbeat channel (cluster/heartbeat.py).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from rayfree.procs import proc_state

from .view import ReplicaView

__all__ = [
    "WorkerStatus",
    "CallStatus",
    "ReplicaStatus",
    "NodeStatus",
    "RelayStatus",
    "relay_status",
    "ClusterStatus",
    "replica_status",
    "worker_statuses",
    "node_status",
    "cluster_status",
    "relays_seen",
    "encode",
    "decode_node",
    "decode_cluster",
]


class WorkerStatus(msgspec.Struct):
    rank: int  # within its DP replica
    global_rank: int  # in the world across DP
    pid: int
    title: str
    state: str  # "running", "sleeping (waiting)", "stopped (SIGSTOP?)", "gone", ...
    device: int | None = None  # its GPU, by index among those it sees (None: no GPU)
    cpus: str = ""  # the CPUs it is bound to, when numa_bind binds it ("" : not bound)


class CallStatus(msgspec.Struct):
    method: str
    age_s: float
    waiting_for: list[int]  # ranks whose replies it still awaits


class ReplicaStatus(msgspec.Struct):
    """A DP replica, as its leader's executor sees it."""

    replica: int
    world_size: int
    failed: str = ""
    calls: list[CallStatus] = []
    #: seconds since each rank's last reply (None: none yet)
    since_reply_s: list[float | None] = []
    ring_chunks: int = 0
    ring_occupied: int = 0
    #: local readers' unread chunks by rank, and the one furthest behind (-1: none is)
    ring_behind: dict[int, int] = {}
    slowest_reader: int = -1
    bytes_broadcast: dict[str, int] = {}
    rpc_failures: int = 0


class RelayStatus(msgspec.Struct):
    """A follower node's relay of its replica's broadcast (transport/relay)."""

    replica: int
    parent: str  # the endpoint it subscribes to: node 0's, or its parent node's relay
    children: list[int]  # the nodes it passes the stream on to
    relayed: int  # messages written into this node's ring
    relayed_bytes: int
    forwarded_bytes: int  # bytes passed on to the children
    ring_occupied: int = 0
    ring_behind: dict[int, int] = {}


class NodeStatus(msgspec.Struct):
    node: int
    ip: str
    pid: int
    ranks: list[int]  # world ranks (across DP) on this node
    replicas: list[int]  # DP replicas with ranks here
    workers: list[WorkerStatus] = []
    leads: list[ReplicaStatus] = []  # the replicas this node leads
    heartbeat_rtt_ms: float | None = None  # a follower's last beat round trip to node 0
    relays: list[RelayStatus] = []  # a follower's relays, one per replica it serves
    #: filled in by node 0: seconds since this node's last heartbeat, and whether it counts as lost
    heartbeat_age_s: float | None = None
    state: str = "ok"
    #: the node process's threads, by name (rayfree's supervisor's: docs/architecture.md lists them)
    threads: list[str] = []


class ReplicaLine(msgspec.Struct):
    """A DP replica's state as node 0 knows it (`Executor.replica_states`)."""

    replica: int
    state: str  # "serving", "lost"
    epoch: int = 0
    why: str = ""


class ClusterStatus(msgspec.Struct):
    nnodes: int
    world_size: int  # of one replica
    data_parallel_size: int
    shape: str
    nodes: list[NodeStatus]
    coupling: str = ""  # "independent", "coupled" or "one-world" (DP > 1)
    replicas: list[ReplicaLine] = []
    #: the DP width asked for (`rayfree scale`), how many replicas take calls, and their membership epoch
    requested_width: int = 0
    serving_width: int = 0
    membership_epoch: int = 0
    #: the node that answered (0: node 0, for the whole cluster; another: a node serving on without node 0, for
    #: itself, `rayfree status --ask`), and why node 0 is lost to it
    answered_by: int = 0
    node_0_lost: str = ""


def worker_statuses(ex: ReplicaView) -> list[WorkerStatus]:
    par = ex.parallel_config
    return [
        WorkerStatus(
            w.rank,
            par.global_rank(w.rank, ex.dp_rank),
            w.proc.pid or -1,
            w.title,
            proc_state(w.proc.pid) if w.proc.pid else "not started",
            w.device,
            _bound_cpus(w.proc.pid),
        )
        for w in ex.workers
    ]


def _bound_cpus(pid: int | None) -> str:
    """`pid`'s CPUs as a cpulist, when they are fewer than this node process's own ("": not bound, or gone)."""
    try:
        mine, its = os.sched_getaffinity(0), os.sched_getaffinity(pid or -1)
    except OSError:
        return ""
    if its >= mine:
        return ""
    runs: list[list[int]] = []
    for c in sorted(its):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def relay_status(ex: ReplicaView) -> RelayStatus | None:
    r = ex.relay_status()
    if not r:
        return None
    per_node = ex.parallel_config.local_ranks
    first = ex.parallel_config.node_rank_within_dp * per_node
    return RelayStatus(
        replica=ex.dp_rank,
        parent=r.get("parent") or "",
        children=[ex.parallel_config.nodes_of_replica(ex.dp_rank)[c // per_node] for c in r.get("children", [])],
        relayed=r.get("relayed", 0),
        relayed_bytes=r.get("relayed_bytes", 0),
        forwarded_bytes=r.get("forwarded_bytes", 0),
        ring_occupied=r.get("occupied", 0),
        ring_behind={first + int(k): int(v) for k, v in (r.get("behind") or {}).items()},
    )


def replica_status(ex: ReplicaView) -> ReplicaStatus:
    snap = ex.rpc_snapshot()
    ring = snap.ring if snap is not None else {}
    behind = {int(r): int(n) for r, n in (ring.get("behind") or {}).items()}
    slowest = max(behind, key=lambda r: behind[r]) if behind and max(behind.values()) > 0 else -1
    return ReplicaStatus(
        replica=ex.dp_rank,
        world_size=ex.world_size,
        failed=str(ex.failure or "")[:500],
        calls=[CallStatus(m, round(a, 3), w) for m, a, w, _ in (snap.calls if snap is not None else [])],
        since_reply_s=[None if t is None else round(t, 3) for t in (snap.since_reply_s if snap is not None else [])],
        ring_chunks=ring.get("chunks", 0),
        ring_occupied=ring.get("occupied", 0),
        ring_behind=behind,
        slowest_reader=slowest,
        bytes_broadcast=dict(ring.get("bytes") or {}),
        rpc_failures=snap.failures if snap is not None else 0,
    )


def node_status(lv: Any) -> NodeStatus:
    """This node (a liveness): its workers, and the replicas it leads (calls in flight, replies, the ring)."""
    from rayfree.supervisor import supervisor

    par = lv.par
    exs = lv.executors()
    rtt = getattr(lv.beater, "rtt_s", None)
    return NodeStatus(
        node=lv.node,
        ip=lv.ip,
        pid=os.getpid(),
        ranks=par.node_ranks(lv.node),
        replicas=par.node_replicas,
        workers=[w for ex in exs for w in worker_statuses(ex)],
        leads=[replica_status(ex) for ex in exs if ex.is_leader],
        heartbeat_rtt_ms=None if rtt is None else round(rtt * 1000, 3),
        relays=[r for r in (relay_status(ex) for ex in exs) if r is not None],
        state="failed" if lv.failure is not None else ("starting" if lv.ready_count < lv.replicas else "ok"),
        threads=sorted(t.name for t in supervisor().threads()),
    )


def relays_seen(lv: Any) -> dict[int, list[RelayStatus]]:
    """Node 0: each follower's relays, from its last heartbeat's status, by node (for the stall report)."""
    out: dict[int, list[RelayStatus]] = {}
    views = lv.beater.peer_views() if lv.node == 0 and lv.beater is not None else []
    for node, _ip, _ranks, _age, _gone, raw in views:
        try:
            out[node] = decode_node(raw).relays if raw else []
        except Exception:  # noqa: BLE001 - an unreadable status: nothing to say of its relay
            out[node] = []
    return out


def cluster_status(lv: Any) -> ClusterStatus:
    """Every node (node 0's view: the others' last reported status and the age of their last beat); on a node
    serving on without node 0, that node alone, and the replicas as it knows them."""
    from rayfree.cluster.join import coupling_of, shape_of

    par = lv.par
    nodes = [node_status(lv)]
    views = lv.beater.peer_views() if lv.node == 0 and lv.beater is not None else []
    for node, ip, ranks, age, gone, raw in views:
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
        if gone:  # (its last report is of processes that are gone: no call of theirs is in flight any more)
            ns.workers = [msgspec.structs.replace(w, state="lost (last reported)") for w in ns.workers]
            ns.leads, ns.relays = [], []
        nodes.append(ns)
    states = lv.replica_epochs.states()
    roster = lv.replica_epochs.roster
    return ClusterStatus(
        nnodes=len(lv.nodes()),  # (with the nodes a scale-out past --dp added)
        world_size=par.world_size,
        data_parallel_size=par.data_parallel_size,
        shape=shape_of(par),
        nodes=nodes,
        coupling=coupling_of(par),
        replicas=[ReplicaLine(k, st.state, st.epoch, st.why) for k, st in states.items()],
        requested_width=roster.requested,
        serving_width=roster.effective,
        membership_epoch=roster.epoch,
        answered_by=lv.node,
        node_0_lost=getattr(lv, "node_0_lost", ""),
    )


encode = msgspec.msgpack.Encoder().encode
decode_node = msgspec.msgpack.Decoder(NodeStatus).decode
decode_cluster = msgspec.msgpack.Decoder(ClusterStatus).decode
