"""`rayfree node`'s options: where each comes from (flag, RAYFREE_*, the config file's [node] table, the
launcher), and the checks that refuse a node that cannot work, before any process starts."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.loading import add_config_arguments, config_path, load_config, resolve
from rayfree.imports import load_object
from rayfree.launch.launchers import CHOICES, LaunchError
from rayfree.launch.placement import Placement, place
from rayfree.settings import parse_flag

__all__ = [
    "NodeUsageError",
    "NodePlan",
    "add_node_arguments",
    "add_security_arguments",
    "apply_security_arguments",
    "plan",
    "port_option",
    "check_port_free",
    "load_entry",
]

logger = logging.getLogger("rayfree.node")

#: the [node] table's keys (the cluster's own fields sit at the file's top level)
NODE_KEYS = ("worker", "entry", "headless", "worker_kwargs", "metrics_port", "health_port", "launcher")


class NodeUsageError(ValueError):
    """The node was started with options that cannot work; the message says which and how to fix them."""


class NodePlan(NamedTuple):
    config: ClusterConfig
    worker: str
    kwargs: dict[str, Any]
    entry: str | None
    placement: Placement


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", metavar="PKG.MOD:CLASS", help="the engine's worker class [RAYFREE_WORKER]")
    p.add_argument(
        "--worker-kwargs",
        metavar="JSON",
        help="keyword arguments for the worker, as a JSON object [RAYFREE_WORKER_KWARGS]",
    )
    p.add_argument(
        "--entry",
        metavar="PKG.MOD:FUNC",
        help="node 0: the engine's driver (pkg.mod:func, or a script: driver.py:main), called with the executor; "
        "its return value is the exit code; under a launcher the other nodes ignore it [RAYFREE_ENTRY]",
    )
    p.add_argument(
        "--headless",
        action="store_const",
        const="1",
        default=None,
        help="a follower node: run this node's workers, no driver [RAYFREE_HEADLESS=1]",
    )
    p.add_argument(
        "--launcher",
        metavar="NAME",
        help=f"where node rank, node count and master address come from when no flag or RAYFREE_* gives them: "
        f"{', '.join(CHOICES)} (default auto: detect) [RAYFREE_LAUNCHER]",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print this node's placement and where each value came from, then exit",
    )
    p.add_argument(
        "--health-port",
        metavar="PORT",
        help="serve GET /livez and /readyz (200 or 503, one-line JSON) at http://0.0.0.0:PORT [RAYFREE_HEALTH_PORT]",
    )
    p.add_argument(
        "--metrics-port",
        metavar="PORT",
        help="serve Prometheus metrics (RPC latency, bytes broadcast, "
        "ring occupancy, heartbeats, failures) at http://0.0.0.0:PORT/metrics; needs rayfree[metrics] "
        "[RAYFREE_METRICS_PORT]",
    )
    add_security_arguments(p)
    add_config_arguments(p)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the cluster secret (`rayfree keygen FILE`) [RAYFREE_SECRET_FILE; in docker, the rayfree_secret secret]",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow plain TCP without a secret, on a trusted "
        "network only (logged as a warning on every node) [RAYFREE_INSECURE=1]",
    )


def apply_security_arguments(args: argparse.Namespace) -> None:
    """This process's security policy from the flags (else the environment); the executor hands it to every
    worker it starts."""
    from rayfree.transport.secure import policy as security

    security.use(
        security.resolve(getattr(args, "secret_file", None), True if getattr(args, "insecure", False) else None)
    )


def _node_options(args: argparse.Namespace, env: dict[str, str] | Any) -> dict[str, str]:
    """`rayfree node`'s own options: each flag, else RAYFREE_<NAME>, else the config file's [node] table
    (cluster/loading.py `resolve`), as text; absent when nobody gave one."""
    try:
        given = resolve(args, env, NODE_KEYS, table="node", others=True)
    except ConfigError as e:
        raise NodeUsageError(f"{e} ({', '.join(NODE_KEYS)})") from None
    unknown = sorted(k for k in given if k not in NODE_KEYS)
    if unknown:
        raise NodeUsageError(f"{config_path(args, env)}: unknown [node] key(s) {unknown}: use {', '.join(NODE_KEYS)}")
    out = {}
    for name, s in given.items():
        v = s.value
        if s.from_file:
            v = json.dumps(v) if isinstance(v, dict) else ("1" if v is True else "0" if v is False else str(v))
        if v:
            out[name] = v
    return out


def load_entry(spec: str) -> Callable[[Any], Any]:
    try:
        obj = load_object(spec, "--entry")
    except ValueError as e:
        raise NodeUsageError(str(e)) from None
    if not callable(obj):
        raise NodeUsageError(f"--entry {spec!r} is not a function")
    return obj


def port_option(args: argparse.Namespace, name: str, env: dict[str, str] | Any = None) -> int | None:
    """--metrics-port / --health-port (or RAYFREE_<NAME>, or the file's [node] table), checked; None: not asked."""
    env = os.environ if env is None else env
    raw = _node_options(args, env).get(name)
    flag = "--" + name.replace("_", "-")
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise NodeUsageError(f"{flag} {raw!r} is not a TCP port: use 1..65535")
    if name == "metrics_port":
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise NodeUsageError("--metrics-port needs prometheus_client: pip install 'rayfree[metrics]'") from None
    return port


def check_port_free(port: int, flag: str) -> None:
    """An HTTP port is ours to bind, before any worker starts (not an OSError once the cluster is up)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds it
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            raise NodeUsageError(
                f"{flag} {port} (RAYFREE_{flag[2:].replace('-', '_').upper()}): port {port} cannot be used here "
                f"({e.strerror}): another process holds it; pick a free port or stop that process"
            ) from None


def placed(args: argparse.Namespace, env: dict[str, str] | Any) -> tuple[argparse.Namespace, Placement]:
    """`args` with what the launcher supplied filled in as if given by flags; the placement itself."""
    try:
        placement = place(args, env, _node_options(args, env).get("launcher"))
    except LaunchError as e:
        raise NodeUsageError(str(e)) from None
    return argparse.Namespace(**{**vars(args), **placement.filled}), placement


def plan(args: argparse.Namespace, env: dict[str, str] | Any = None) -> NodePlan:
    """Config, worker class, worker kwargs, entry point and placement of this node; NodeUsageError when they
    cannot work."""
    env = os.environ if env is None else env
    args, placement = placed(args, env)
    config = load_config(args, env=env)
    par = config.parallel
    given = _node_options(args, env)
    worker = given.get("worker")
    if not worker:
        raise NodeUsageError("give the worker class: --worker package.module:Class (or RAYFREE_WORKER)")
    raw_kwargs = given.get("worker_kwargs")
    try:
        kwargs = json.loads(raw_kwargs) if raw_kwargs else {}
    except json.JSONDecodeError as e:
        raise NodeUsageError(f"--worker-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise NodeUsageError('--worker-kwargs must be a JSON object, e.g. \'{"model": "..."}\'')
    try:
        headless = parse_flag(str(given.get("headless", "0")))
    except ValueError as e:
        raise NodeUsageError(f"RAYFREE_HEADLESS: {e}") from None
    entry = given.get("entry")
    leader = par.node_rank_within_dp == 0
    if placement.launch is not None and "node_rank" in placement.filled and not leader:
        # One command on every node (srun, a LeaderWorkerSet template): the entry is node 0's alone.
        entry, headless = None, True
    _check_role(par, leader, headless, entry)
    _check_host_ip(env)
    return NodePlan(config, worker, kwargs, entry, placement)


def _check_host_ip(env: dict[str, str] | Any) -> None:
    """RAYFREE_HOST_IP names this node's own address; one exported to every task (sbatch --export=ALL, a
    shared env file) would make each node claim another's."""
    from rayfree.transport.net import HOST_IP_ENV, is_local_address, local_addresses

    ip = env.get(HOST_IP_ENV)
    if ip and not is_local_address(ip):
        raise NodeUsageError(
            f"{HOST_IP_ENV}={ip} is not an address of this machine (it has {', '.join(sorted(local_addresses()))}): "
            f"was it exported to every node? Leave it unset (rayfree finds the address that routes to node 0)"
        )


def _check_role(par: Any, leader: bool, headless: bool, entry: str | None) -> None:
    replica = f"DP replica {par.dp_rank}" if par.data_parallel_size > 1 else "its replica"
    followers = par.nodes_of_replica(par.dp_rank)[1:]
    if par.nnodes > 1:
        from rayfree.transport.secure.policy import insecure, process_secret

        if process_secret() is None and not insecure():
            raise NodeUsageError(
                "a multi-node cluster talks over TCP, and rayfree refuses unauthenticated TCP: "
                "run `rayfree keygen FILE` once, give every node --secret-file FILE (or "
                "RAYFREE_SECRET_FILE; in compose, the rayfree_secret secret), or pass "
                "--insecure on a trusted network"
            )
    if leader and headless:
        raise NodeUsageError(
            f"node_rank={par.node_rank} leads {replica}, so it cannot be --headless"
            + (
                f": its followers are node(s) {followers}"
                if followers
                else " (with this many nodes per replica, every node leads one)"
            )
        )
    if leader and not entry:
        raise NodeUsageError(
            f"node {par.node_rank} leads {replica} and runs the engine: give --entry "
            f"package.module:function (called with the executor)"
            + (
                ", or start a follower with --headless and another --node-rank"
                if followers or par.nnodes_within_dp > 1
                else ""
            )
        )
    if not leader and entry:
        raise NodeUsageError(
            f"node {par.node_rank} is a follower of {replica}: only its first node "
            f"({par.nodes_of_replica(par.dp_rank)[0]}) runs the entry point; drop --entry "
            f"(RAYFREE_ENTRY) here"
        )
