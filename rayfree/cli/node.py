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

The steps, each a method of `_Node`: plan (options, placement, ports), the
probes and metrics, the replicas (NodeReplicas), then lead (the entry points,
under the restart contract's watch) or serve (a follower), and close. A
SIGTERM / SIGINT is a stop request to the node's policy (executor/failure_policy.py),
which stops the executors on its own thread; it never raises in the middle of
whatever the main thread is doing (except before the policy exists).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import msgspec

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
    """SIGTERM / SIGINT before the node's policy exists: stop start-up (a BaseException: no `except Exception`
    swallows it)."""

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
    from rayfree.cluster.join import coupling_of
    from rayfree.cluster.loading import OPERATOR_FIELDS

    shown = {**msgspec.structs.asdict(p.config), **msgspec.structs.asdict(par)}
    if par.data_parallel_size > 1 and par.replica_coupling == "auto":
        shown["replica_coupling"] = f"auto ({coupling_of(par)})"
    for name in OPERATOR_FIELDS:
        if name not in ("nnodes", "node_rank", "master_addr", "master_port"):  # (the placement's lines say them)
            print(f"  {name:<11} = {shown[name]}")
    role = "leader, runs " + str(p.entry) if p.entry else "follower (headless)"
    hosts = f"; hosts {', '.join(launch.hosts)}" if launch and launch.hosts else ""
    print(
        f"  node {par.node_rank} of {par.nnodes}: {role}; ranks {par.node_ranks(par.node_rank)} of world "
        f"{par.world_size_across_dp}; heartbeat port {p.config.heartbeat_endpoint_port}{hosts}"
    )


def run_node(args: argparse.Namespace) -> int:
    logs.configure()
    try:
        node = _Node.planned(args)
    except (NodeUsageError, ConfigError, TransportError) as e:
        print(f"rayfree node: {e}", file=sys.stderr)
        return EXIT_USAGE
    if node is None:  # --dry-run
        return 0
    return node.run()


class _Node:
    """One `rayfree node` run, as named steps (the module docstring)."""

    def __init__(self, p: NodePlan, entry: Callable[[Any], Any] | None, metrics_port: int | None,
                 health_port: int | None) -> None:  # fmt: skip
        self.plan = p
        self.config = p.config
        self.par = p.config.parallel
        self.entry = entry
        self.metrics_port = metrics_port
        self.health_port = health_port
        self.liveness: Any = None
        self.reps: Any = None
        self.probes: Any = None
        self.metrics: list[Any] = []
        self._old_handlers: dict[int, Any] = {}

    @classmethod
    def planned(cls, args: argparse.Namespace) -> _Node | None:
        """Options, placement and ports, checked before anything starts (None: --dry-run printed the plan)."""
        apply_security_arguments(args)
        p = plan(args)
        if getattr(args, "dry_run", False):
            print_plan(p)
            return None
        entry = load_entry(p.entry) if p.entry else None
        metrics_port = port_option(args, "metrics_port")
        health_port = port_option(args, "health_port")
        for flag, value in (("--metrics-port", metrics_port), ("--health-port", health_port)):
            if value is not None:
                check_port_free(value, flag)
        if metrics_port is not None and metrics_port == health_port:
            raise NodeUsageError(f"--metrics-port and --health-port are both {metrics_port}: give them different ports")
        return cls(p, entry, metrics_port, health_port)

    # -- the run -------------------------------------------------------------------------------------------

    def run(self) -> int:
        self._log_placement()
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        from rayfree.executor.errors import ExecutorError

        try:
            if self._refused():
                return EXIT_USAGE
            self._start_probes()
            self._start_replicas()
            return self._lead() if self.entry is not None else self._serve()
        except _StopRequested as e:
            logger.warning("node %d: %s received during start-up; stopping", self.par.node_rank, e)
            return 0
        except EntryInterrupted as e:
            logger.error("%s", e)
            return self._stopped_code()
        except ConfigError as e:  # found once the node is up (a master port another process holds): bad usage
            print(f"rayfree node: {e}", file=sys.stderr)
            return EXIT_USAGE
        except ExecutorError as e:
            if self._asked_to_stop():
                return self._stopped_code()
            text = str(e)  # LeaderLost names this node already
            node = self.par.node_rank
            logger.error("%s", text if text.startswith(f"node {node}:") else f"node {node}: {text}")
            return EXIT_FAILED
        except Exception as e:  # noqa: BLE001 - start-up errors: print them plainly, not as a crash
            lv = self.liveness
            if lv is not None and lv.stopped_cleanly and lv.failure is None:  # (a replacement still starting)
                logger.info("node %d: node 0 stopped the cluster while this node started", self.par.node_rank)
                return 0
            logger.error("node %d: %s: %s", self.par.node_rank, type(e).__name__, e)
            logger.debug("traceback", exc_info=True)
            return EXIT_FAILED
        finally:
            self._close()

    def _log_placement(self) -> None:
        p, par = self.plan, self.par
        if p.placement.launch is not None:
            logger.info(
                "node placed by %s: %s",
                p.placement.launch.launcher,
                "; ".join(p.placement.describe()).replace("  ", " "),
            )
        role = "leader" if self.entry else "follower"
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
            p.worker,
        )

    def _refused(self) -> bool:
        """Node 0 whose master port another process holds: one line now, the followers told, exit 2."""
        from rayfree.executor.liveness import for_node
        from rayfree.executor.startup import MasterPortInUse, check_master_port

        try:
            check_master_port(self.config)
        except MasterPortInUse as e:
            print(f"rayfree node: {e}", file=sys.stderr, flush=True)
            if self.par.nnodes > 1:
                for_node(self.config).refuse(f"node 0 refused to start: {e}")
            return True
        return False

    def _start_probes(self) -> None:
        if self.health_port is not None:
            from .probes import HealthServer

            self.probes = HealthServer(self.health_port, self.par.node_rank)

    def _on_liveness(self, liveness: Any) -> None:
        """The node's liveness exists (before any executor starts): the probes and metrics read it."""
        self.liveness = liveness
        if self.probes is not None:
            self.probes.liveness = liveness
        if self.metrics_port is not None:
            from .metrics import serve_metrics

            self.metrics.append(serve_metrics(self.metrics_port, liveness))

    def _start_replicas(self) -> None:
        from rayfree.executor.replicas import NodeReplicas

        p = self.plan
        self.reps = NodeReplicas(self.config, p.worker, p.kwargs, on_liveness=self._on_liveness)

    def _lead(self) -> int:
        """Run the entry point for every replica this node leads; then wait until the whole cluster may stop.

        An entry that raises fails the cluster (every node stops, non-zero); one that returns a code ends its
        replica cleanly, and the node exits with the first non-zero code once every replica is done. An
        independent replica of this node that was lost (`ReplicaLost`) leaves the others running; the node
        exits non-zero once they are done.
        """
        from rayfree.executor.errors import ExecutorError, ReplicaDrained, ReplicaLost

        reps = self.reps
        assert self.entry is not None
        with EntryWatch(reps.liveness, self.par.node_rank, EXIT_FAILED):
            results = reps.run(self.entry)
        if self._asked_to_stop():
            return self._stopped_code()
        gone = reps.liveness.policy.lost
        lost = sorted(k for k in self.par.node_replicas if k in gone and not isinstance(gone[k], ReplicaDrained))
        raised = [
            (ex, r)
            for ex, r in zip(reps.leaders, results)
            if isinstance(r, BaseException) and not (isinstance(r, ReplicaLost) and ex.dp_rank in gone)
        ]
        for ex, e in raised:
            if not isinstance(e, ExecutorError):  # the engine's own error: the other nodes must stop too
                ex.note_stop_reason(f"DP replica {ex.dp_rank}'s entry point raised {type(e).__name__}: {e}")
        if raised:
            if not isinstance(raised[0][1], ExecutorError):
                logger.error("%s", raised[0][0].stop_reason)
            return EXIT_FAILED
        if not reps.finish():
            logger.error("node %d: the cluster failed: %s", self.par.node_rank, reps.failure)
            return EXIT_FAILED
        if lost:
            logger.error(
                "node %d: DP replica(s) %s of this node were lost; the others are done", self.par.node_rank, lost
            )
            return EXIT_FAILED
        codes = [r if isinstance(r, int) else 0 for r in results]
        return next((c for c in codes if c), 0)

    def _serve(self) -> int:
        """A follower: serve the leader until the cluster stops."""
        par = self.par
        logger.info("node %d: %d worker(s) ready; serving the leader until it stops", par.node_rank, par.local_ranks)
        while not self.reps.wait_done(1.0):
            pass
        if self._asked_to_stop():
            return self._stopped_code()
        if self.reps.failure is not None:
            logger.error("node %d stopped: %s", par.node_rank, self.reps.failure)
            return EXIT_FAILED
        return 0

    # -- stopping -----------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM / SIGINT: a stop request to the node's policy (once), which stops the executors on its thread.
        If a peer looks failed already (a launcher that stops every node because one died), it is a failure."""
        from rayfree.executor.health import suspect

        name = f"{signal.Signals(signum).name} on node {self.par.node_rank}"
        lv = self.liveness
        if lv is None:
            raise _StopRequested(signum)  # nothing runs yet that a request could reach
        if lv.stop_requested:
            return
        seen = suspect(lv)
        logger.warning("node %d: %s received; stopping%s", self.par.node_rank, signal.Signals(signum).name,
                       f" (and before it: {seen})" if seen else "")  # fmt: skip
        if self.probes is not None:
            self.probes.stopping = f"{signal.Signals(signum).name} received" + (f" after: {seen}" if seen else "")
        if seen:  # the launcher stops us because a peer failed: a failure, and peers may hang in gloo: at once
            from rayfree.executor.errors import ExecutorFailed

            lv.fail_all(ExecutorFailed(f"node {self.par.node_rank}: stopped by {signal.Signals(signum).name} "
                                       f"after: {seen}"))  # fmt: skip
            return
        lv.stop_requested = name  # the other nodes stop cleanly too
        lv.policy.stop(None, wait=False)

    def _asked_to_stop(self) -> bool:
        lv = self.liveness
        return lv is not None and bool(lv.stop_requested)

    def _stopped_code(self) -> int:
        """An operator's stop: 0, unless the cluster had failed by then."""
        lv = self.liveness
        return EXIT_FAILED if lv is not None and lv.failure is not None else 0

    def _close(self) -> None:
        for s in self._old_handlers:  # the shutdown is bounded by its stages; a second signal must not cut it short
            signal.signal(s, signal.SIG_IGN)
        if self.reps is not None:
            self.reps.shutdown()
        for server in self.metrics:
            server.shutdown()
        if self.probes is not None:
            self.probes.close()
        for s, h in self._old_handlers.items():
            signal.signal(s, h)


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
