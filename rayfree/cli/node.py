"""`rayfree node`: run one node of a cluster — a leader with the engine's entry point, or a headless follower.

With data parallelism (--dp D) the nodes split into D replicas of nnodes/D
nodes each (or, when D >= nnodes, each node holds D/nnodes whole replicas).
The first node of each replica leads it: it runs an executor and the entry
point, called with that executor (`ex.dp_rank` says which replica); the
replica's other nodes are headless followers. Every rank of every replica
joins one torch.distributed world at master_addr:master_port (node 0), and
node 0 watches every node's heartbeats (executor/liveness.py).

Every option also comes from the environment (RAYFREE_WORKER, RAYFREE_ENTRY,
RAYFREE_HEADLESS, RAYFREE_WORKER_KWARGS and every RAYFREE_<config field>) and
from a config file (the cluster fields, plus a [node] table with worker,
entry, headless, worker_kwargs), so a compose file can hold the whole invocation.

Exit codes: 0 clean stop (every entry returned 0 and node 0 stopped the
cluster, or SIGTERM); 1 the cluster failed (a node or worker lost, node 0
gone), even if an entry point returned 0 after seeing it; 2 bad usage;
otherwise the first non-zero code an entry point returned.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from rayfree import logs
from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.loading import add_config_arguments, load_config
from rayfree.imports import load_object
from rayfree.transport.errors import TransportError

__all__ = ["add_node_arguments", "run_node", "NodeUsageError"]

logger = logging.getLogger("rayfree.node")

EXIT_FAILED = 1
EXIT_USAGE = 2


class NodeUsageError(ValueError):
    """The node was started with options that cannot work; the message says which and how to fix them."""


class _StopRequested(BaseException):
    """SIGTERM / SIGINT: stop this node cleanly (a BaseException so no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
        help="node 0: the engine's driver, called with the executor; its return value is the exit code [RAYFREE_ENTRY]",
    )
    p.add_argument(
        "--headless",
        action="store_const",
        const="1",
        default=None,
        help="a follower node: run this node's workers, no driver [RAYFREE_HEADLESS=1]",
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


def _option(args: argparse.Namespace, name: str, env: dict[str, str] | Any, file: dict[str, Any]) -> str | None:
    """Flag, else RAYFREE_<NAME>, else the config file's [node] table."""
    v = getattr(args, name, None)
    if v is None:
        v = env.get("RAYFREE_" + name.upper())
    if v is None and name in file:
        v = file[name]
        v = json.dumps(v) if isinstance(v, dict) else ("1" if v is True else "0" if v is False else str(v))
    return v or None


def _file_options(args: argparse.Namespace, env: dict[str, str] | Any) -> dict[str, Any]:
    from rayfree.cluster.config import _read_file

    path = getattr(args, "config", None) or env.get("RAYFREE_CONFIG")
    node = _read_file(path).get("node", {}) if path else {}
    if not isinstance(node, dict):
        raise NodeUsageError(f"{path}: [node] must be a table (worker, entry, headless, worker_kwargs)")
    unknown = set(node) - {"worker", "entry", "headless", "worker_kwargs", "metrics_port"}
    if unknown:
        raise NodeUsageError(
            f"{path}: unknown [node] key(s) {sorted(unknown)}: use worker, entry, headless, worker_kwargs, metrics_port"
        )
    return node


def _load_entry(spec: str) -> Callable[[Any], Any]:
    try:
        obj = load_object(spec, "--entry")
    except ValueError as e:
        raise NodeUsageError(str(e)) from None
    if not callable(obj):
        raise NodeUsageError(f"--entry {spec!r} is not a function")
    return obj


def metrics_port(args: argparse.Namespace, env: dict[str, str] | Any = None) -> int | None:
    """--metrics-port (or RAYFREE_METRICS_PORT, or the file's [node] metrics_port), checked; None: no metrics."""
    env = os.environ if env is None else env
    raw = _option(args, "metrics_port", env, _file_options(args, env))
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise NodeUsageError(f"--metrics-port {raw!r} is not a TCP port: use 1..65535")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise NodeUsageError("--metrics-port needs prometheus_client: pip install 'rayfree[metrics]'") from None
    return port


def _check_port_free(port: int) -> None:
    """The metrics port is ours to bind, before any worker starts (not an OSError once the cluster is up)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds it
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            raise NodeUsageError(
                f"--metrics-port {port} (RAYFREE_METRICS_PORT): port {port} cannot be used here "
                f"({e.strerror}): another process holds it; pick a free port or stop that "
                f"process"
            ) from None


def plan(args: argparse.Namespace, env: dict[str, str] | Any = None) -> tuple[ClusterConfig, str, dict, str | None]:
    """Config, worker class, worker kwargs and entry point of this node; NodeUsageError when they cannot work."""
    env = os.environ if env is None else env
    config = load_config(args, env=env)
    par = config.parallel
    file = _file_options(args, env)
    worker = _option(args, "worker", env, file)
    if not worker:
        raise NodeUsageError("give the worker class: --worker package.module:Class (or RAYFREE_WORKER)")
    raw_kwargs = _option(args, "worker_kwargs", env, file)
    try:
        kwargs = json.loads(raw_kwargs) if raw_kwargs else {}
    except json.JSONDecodeError as e:
        raise NodeUsageError(f"--worker-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise NodeUsageError('--worker-kwargs must be a JSON object, e.g. \'{"model": "..."}\'')
    headless = (_option(args, "headless", env, file) or "0").strip().lower() in ("1", "true", "yes")
    entry = _option(args, "entry", env, file)
    leader = par.node_rank_within_dp == 0
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
    return config, worker, kwargs, entry


def run_node(args: argparse.Namespace) -> int:
    logs.configure()
    try:
        apply_security_arguments(args)
        config, worker, kwargs, entry_spec = plan(args)
        entry = _load_entry(entry_spec) if entry_spec else None
        port = metrics_port(args)
        if port is not None:
            _check_port_free(port)
    except (NodeUsageError, ConfigError, TransportError) as e:
        print(f"rayfree node: {e}", file=sys.stderr)
        return EXIT_USAGE
    par = config.parallel
    role = "leader" if entry else "follower"
    dp = f", DP replica(s) {par.node_replicas} of {par.data_parallel_size}" if par.data_parallel_size > 1 else ""
    logger.info(
        "node %d/%d (%s%s): %d rank(s) from %d, master %s:%d, worker %s",
        par.node_rank,
        par.nnodes,
        role,
        dp,
        par.local_ranks,
        par.global_start_rank,
        par.master_addr,
        par.master_port,
        worker,
    )

    lives: list[Any] = []  # this node's liveness, once made

    def on_signal(signum: int, frame: Any) -> None:
        for lv in lives:  # an operator's stop: the other nodes stop cleanly too
            lv.stop_requested = f"{signal.Signals(signum).name} on node {par.node_rank}"
        raise _StopRequested(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    from rayfree.executor.errors import ExecutorError
    from rayfree.executor.replicas import NodeReplicas

    reps: NodeReplicas | None = None
    metrics: list[Any] = []

    def on_liveness(liveness: Any) -> None:
        lives.append(liveness)
        if port is not None:
            from .metrics import serve_metrics

            metrics.append(serve_metrics(port, liveness))

    try:
        reps = NodeReplicas(config, worker, kwargs, on_liveness=on_liveness)
        if entry is not None:
            return _lead(reps, entry)
        logger.info("node %d: %d worker(s) ready; serving the leader until it stops", par.node_rank, par.local_ranks)
        while not reps.wait_done(1.0):
            pass
        if reps.failure is not None:
            logger.error("node %d stopped: %s", par.node_rank, reps.failure)
            return EXIT_FAILED
        return 0
    except _StopRequested as e:
        logger.warning("node %d: %s received; stopping", par.node_rank, e)
        return 0
    except ExecutorError as e:
        text = str(e)  # LeaderLost names this node already
        logger.error("%s", text if text.startswith(f"node {par.node_rank}:") else f"node {par.node_rank}: {text}")
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - start-up errors: print them plainly, not as a crash
        logger.error("node %d: %s: %s", par.node_rank, type(e).__name__, e)
        logger.debug("traceback", exc_info=True)
        return EXIT_FAILED
    finally:
        for s in old:  # the shutdown is bounded by its stages; a second signal must not cut it short
            signal.signal(s, signal.SIG_IGN)
        if reps is not None:
            reps.shutdown()
        for server in metrics:
            server.shutdown()
        for s, h in old.items():
            signal.signal(s, h)


def _lead(reps: Any, entry: Callable[[Any], Any]) -> int:
    """Run the entry point for every replica this node leads; then wait until the whole cluster may stop.

    An entry that raises fails the cluster (every node stops, non-zero); one that returns a code ends its
    replica cleanly, and the node exits with the first non-zero code once every replica is done.
    """
    from rayfree.executor.errors import ExecutorError

    results = reps.run(entry)
    raised = [(ex, r) for ex, r in zip(reps.leaders, results) if isinstance(r, BaseException)]
    for ex, e in raised:
        if not isinstance(e, ExecutorError):  # the engine's own error: the other nodes must stop too
            ex.note_stop_reason(f"DP replica {ex.dp_rank}'s entry point raised {type(e).__name__}: {e}")
    if raised:
        if not isinstance(raised[0][1], ExecutorError):
            logger.error("%s", raised[0][0]._stop_reason)
        return EXIT_FAILED
    if not reps.finish():
        logger.error("node %d: the cluster failed: %s", reps.config.parallel.node_rank, reps.failure)
        return EXIT_FAILED
    codes = [r if isinstance(r, int) else 0 for r in results]
    return next((c for c in codes if c), 0)
