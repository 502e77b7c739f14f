"""`rayfree status`: ask node 0 what the cluster is doing; a table for people, `--json` for scripts.
`rayfree drain K`: ask node 0 to drain DP replica K (executor/drain.py).

Reads the same options as `rayfree node` (master_addr, master_port or
heartbeat_port, the secret), so on any node, in its container or shell, the
same environment that started the node is enough.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from rayfree.executor.status_messages import ClusterStatus, NodeStatus

__all__ = ["run_status", "run_drain", "format_status"]


def _ask(args: argparse.Namespace, command: str, msg: object) -> bytes | int:
    """Node 0's answer to `msg`, or the exit code after a one-line error (2 bad usage, 1 no answer)."""
    from rayfree.cluster.config import ConfigError
    from rayfree.cluster.heartbeat_client import ask_node0
    from rayfree.cluster.loading import load_config
    from rayfree.transport.errors import TransportError

    try:
        config = load_config(args, check_local_master=False)  # asked from any node
    except ConfigError as e:
        print(f"rayfree {command}: {e}", file=sys.stderr)
        return 2
    par = config.parallel
    if not par.master_addr:
        print(f"rayfree {command}: give the cluster's node 0: --master-addr (or RAYFREE_MASTER_ADDR)", file=sys.stderr)
        return 2
    ask = getattr(args, "ask", None)
    try:
        return ask_node0(ask or par.master_addr, config.heartbeat_endpoint_port, msg, args.timeout,  # type: ignore[arg-type]
                         who=f"the node at {ask}" if ask else "node 0")  # fmt: skip
    except (TimeoutError, TransportError) as e:
        print(f"rayfree {command}: {e}", file=sys.stderr)
        return 1


def run_drain(args: argparse.Namespace) -> int:
    """Node 0 drains the replica, or says why not (exit 1)."""
    from rayfree.cluster.heartbeat_messages import DrainReplica

    return _one_line(args, "drain", DrainReplica(args.replica))


def run_scale(args: argparse.Namespace) -> int:
    """Node 0 sets the requested DP width, or says why not (exit 1)."""
    from rayfree.cluster.heartbeat_messages import ScaleReplicas

    width = getattr(args, "data_parallel_size", None)
    if width is None:
        print("rayfree scale: give the DP width to serve at: rayfree scale --dp WIDTH", file=sys.stderr)
        return 2
    try:
        n = int(width)
    except ValueError:
        print(f"rayfree scale: --dp {width!r} is not a whole number of DP replicas", file=sys.stderr)
        return 2
    if n < 1:
        print(f"rayfree scale: --dp {n}: the width must be a whole number >= 1 (to stop the cluster, stop node 0)",
              file=sys.stderr)  # fmt: skip
        return 2
    args.data_parallel_size = None  # (the width asked for is not the layout: the rest of the options are, as given)
    return _one_line(args, "scale", ScaleReplicas(n))


def _one_line(args: argparse.Namespace, command: str, msg: Any) -> int:
    raw = _ask(args, command, msg)
    if isinstance(raw, int):
        return raw
    line = raw.decode(errors="replace") or "refused: node 0 is still starting"
    refused = line.startswith("refused")
    print(f"rayfree {command}: {line}", file=sys.stderr if refused else sys.stdout)
    return 1 if refused else 0


def run_status(args: argparse.Namespace) -> int:
    from rayfree.cluster.heartbeat_messages import StatusQuery
    from rayfree.executor.status_messages import decode_cluster

    raw = _ask(args, "status", StatusQuery())
    if isinstance(raw, int):
        return raw
    if not raw:
        print("rayfree status: node 0 answered but has no status to give (still starting?)", file=sys.stderr)
        return 1
    status = decode_cluster(raw)
    if args.json:
        print(json.dumps(msgspec.to_builtins(status), indent=2))
    else:
        print(format_status(status))
    return 0


def _age(s: float | None) -> str:
    return "-" if s is None else (f"{s * 1000:.0f}ms" if s < 1 else f"{s:.1f}s")


def format_status(st: ClusterStatus) -> str:
    started = f" (started as {st.shape})" if f"nnodes={st.nnodes} " not in f"{st.shape} " else f", {st.shape}"
    lines = [f"cluster: {st.nnodes} node(s){started}, {st.world_size} rank(s) per replica"]
    if st.answered_by:
        lines.append(
            f"node 0 is lost ({st.node_0_lost or 'as node ' + str(st.answered_by) + ' knows'}): node {st.answered_by}"
            f" answers for itself (its own node, and every replica's state as it last knew it); nothing is "
            f"admitted, drained or scaled until node 0 is back"
        )
    lines.append(f"{'node':<5}{'ip':<16}{'state':<12}{'heartbeat':<11}{'rtt':<9}{'ranks':<18}replicas")
    for n in st.nodes:
        beat = "self" if n.node == st.answered_by else _age(n.heartbeat_age_s)
        rtt = "-" if n.heartbeat_rtt_ms is None else f"{n.heartbeat_rtt_ms:.2f}ms"
        lines.append(f"{n.node:<5}{n.ip:<16}{n.state:<12}{beat:<11}{rtt:<9}{str(n.ranks):<18}{n.replicas}")
    if st.coupling:
        lines += [
            "",
            f"DP replicas ({st.coupling}): width {st.serving_width} serving of {st.requested_width} "
            f"requested, membership epoch {st.membership_epoch}",
        ]
        lines += [f"  replica {r.replica}: {r.state}, epoch {r.epoch}" + (f" ({r.why})" if r.why else "")
                  for r in st.replicas]  # fmt: skip
    lines.append("")
    width = max([len(w.title) for n in st.nodes for w in n.workers] + [12]) + 11
    placed = any(w.device is not None or w.cpus for n in st.nodes for w in n.workers)
    lines.append(
        f"{'node':<5}{'rank':<6}{'world':<7}{'pid':>8}  {'process':<{width}}state"
        + ("  [device cpus]" if placed else "")
    )
    for n in st.nodes:
        for w in n.workers:
            where = f"  [{'-' if w.device is None else w.device} {w.cpus or '-'}]" if placed else ""
            lines.append(
                f"{n.node:<5}{w.rank:<6}{w.global_rank:<7}{w.pid:>8}  {'rayfree::' + w.title:<{width}}{w.state}{where}"
            )
        if not n.workers:
            lines.append(f"{n.node:<5}(no worker reported" + (": node lost)" if n.state == "lost" else ")"))
    for n in st.nodes:
        for r in n.leads:
            lines += _replica_lines(n, r)
    relays = [(n, r) for n in st.nodes for r in n.relays]
    if relays:
        lines += ["", f"{'node':<5}{'replica':<9}{'relayed':<10}{'bytes in':<14}{'bytes out':<14}{'ring':<8}from / to"]
        for n, r in relays:
            behind = max(r.ring_behind.values(), default=0)
            lines.append(
                f"{n.node:<5}{r.replica:<9}{r.relayed:<10}{r.relayed_bytes:<14}{r.forwarded_bytes:<14}"
                f"{r.ring_occupied:<8}{r.parent} -> nodes {r.children or '-'}"
                + (f"; a rank is {behind} chunk(s) behind" if behind else "")
            )
    return "\n".join(lines)


def _replica_lines(n: NodeStatus, r) -> list[str]:
    head = f"replica {r.replica} (led by node {n.node})" + (f": FAILED {r.failed}" if r.failed else "")
    out = ["", head]
    if r.calls:
        for c in r.calls:
            out.append(f"  call in flight: {c.method}, {_age(c.age_s)}, waiting for rank(s) {c.waiting_for}")
    else:
        out.append("  no call in flight")
    out.append("  since last reply: " + ", ".join(f"rank {i} {_age(s)}" for i, s in enumerate(r.since_reply_s)))
    if r.ring_chunks:
        slow = (
            f"; slowest reader rank {r.slowest_reader} ({r.ring_behind[r.slowest_reader]} chunk(s) behind)"
            if r.slowest_reader >= 0
            else "; no reader behind"
        )
        out.append(f"  broadcast ring: {r.ring_occupied}/{r.ring_chunks} chunks occupied{slow}")
    if r.bytes_broadcast:
        out.append("  bytes broadcast: " + ", ".join(f"{k} {v}" for k, v in r.bytes_broadcast.items()))
    return out
