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
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from rayfree import logs
from rayfree.cluster.config import ConfigError
from rayfree.procs import exit_now
from rayfree.transport.errors import TransportError

from .entry_watch import EntryInterrupted, EntryWatch
from .node_options import (
    NodePlan,
    NodeUsageError,
    apply_security_arguments,
    check_port_free,
    load_entry,
    plan,
    port_option,
)

__all__ = ["run_node", "leave", "NodeUsageError"]

logger = logging.getLogger("rayfree.node")

EXIT_FAILED = 1
EXIT_USAGE = 2


class _StopRequested(BaseException):
    """SIGTERM / SIGINT: stop this node cleanly (a BaseException so no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def print_plan(p: NodePlan) -> None:
    """`--dry-run`: the placement and where each value came from, the role, the ranks here."""
    par = p.config.parallel
    launch = p.placement.launch
    print(f"rayfree node: launcher {launch.launcher if launch else 'none detected'}")
    for line in p.placement.describe():
        print(f"  {line}")
    role = "leader, runs " + str(p.entry) if p.entry else "follower (headless)"
    hosts = f"; hosts {', '.join(launch.hosts)}" if launch and launch.hosts else ""
    print(
        f"  node {par.node_rank} of {par.nnodes}: {role}; ranks {par.node_ranks(par.node_rank)} of world "
        f"{par.world_size_across_dp}; heartbeat port {p.config.heartbeat_endpoint_port}{hosts}"
    )


def run_node(args: argparse.Namespace) -> int:
    logs.configure()
    try:
        apply_security_arguments(args)
        p = plan(args)
        if getattr(args, "dry_run", False):
            print_plan(p)
            return 0
        config, worker, kwargs, entry_spec = p.config, p.worker, p.kwargs, p.entry
        entry = load_entry(entry_spec) if entry_spec else None
        port = port_option(args, "metrics_port")
        health_port = port_option(args, "health_port")
        for flag, value in (("--metrics-port", port), ("--health-port", health_port)):
            if value is not None:
                check_port_free(value, flag)
        if port is not None and port == health_port:
            raise NodeUsageError(f"--metrics-port and --health-port are both {port}: give them different ports")
    except (NodeUsageError, ConfigError, TransportError) as e:
        print(f"rayfree node: {e}", file=sys.stderr)
        return EXIT_USAGE
    if p.placement.launch is not None:
        logger.info(
            "node placed by %s: %s", p.placement.launch.launcher, "; ".join(p.placement.describe()).replace("  ", " ")
        )
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
    probes = None
    if health_port is not None:
        from .health import HealthServer

        probes = HealthServer(health_port, par.node_rank)

    def on_liveness(liveness: Any) -> None:
        lives.append(liveness)
        if probes is not None:
            probes.liveness = liveness
        if port is not None:
            from .metrics import serve_metrics

            metrics.append(serve_metrics(port, liveness))

    try:
        if _refused(config):
            return EXIT_USAGE
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
        from rayfree.executor.health import suspect

        seen = suspect(lives[0]) if lives else ""
        logger.warning(
            "node %d: %s received; stopping%s", par.node_rank, e, f" (and before it: {seen})" if seen else ""
        )
        if seen:  # the launcher stops us because a peer failed: a failure, and peers may hang in gloo: at once
            from rayfree.executor.errors import ExecutorFailed

            lives[0].fail_all(ExecutorFailed(f"node {par.node_rank}: stopped by {e} after: {seen}"))
            if probes is not None:
                probes.stopping = f"{e} received after: {seen}"
            return EXIT_FAILED
        if probes is not None:
            probes.stopping = f"{e} received"
        return 0
    except EntryInterrupted as e:
        logger.error("%s", e)
        return EXIT_FAILED
    except ConfigError as e:  # found once the node is up (a master port another process holds): bad usage
        print(f"rayfree node: {e}", file=sys.stderr)
        return EXIT_USAGE
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
        if probes is not None:
            probes.close()
        for s, h in old.items():
            signal.signal(s, h)


def _refused(config: Any) -> bool:
    """Node 0 whose master port another process holds: one line now, the followers told, exit 2."""
    from rayfree.executor.liveness import NodeLiveness
    from rayfree.executor.startup import MasterPortInUse, check_master_port

    try:
        check_master_port(config)
    except MasterPortInUse as e:
        print(f"rayfree node: {e}", file=sys.stderr, flush=True)
        if config.parallel.nnodes > 1:
            NodeLiveness(config).refuse(f"node 0 refused to start: {e}")
        return True
    return False


def leave(code: int) -> NoReturn:
    """Exit with `code` once the node has shut down. A failed node (non-zero) leaves without the interpreter's
    own teardown: its atexit handlers run (closed writers' last messages, the logs), but not the finalisation
    of every module and C++ static (about a second with torch loaded), nor a wait for threads the engine left
    running, which would keep the node alive after its cluster is gone (the restart contract). A clean stop
    (0) exits as Python does, so whatever the engine left open is flushed and closed."""
    if code == 0:
        sys.exit(0)
    left = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    if left:
        logger.info("leaving with the engine's thread(s) %s still running", left)
    exit_now(code)


def _lead(reps: Any, entry: Callable[[Any], Any]) -> int:
    """Run the entry point for every replica this node leads; then wait until the whole cluster may stop.

    An entry that raises fails the cluster (every node stops, non-zero); one that returns a code ends its
    replica cleanly, and the node exits with the first non-zero code once every replica is done.
    """
    from rayfree.executor.errors import ExecutorError

    with EntryWatch(reps.liveness, reps, reps.config.parallel.node_rank, EXIT_FAILED):
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
