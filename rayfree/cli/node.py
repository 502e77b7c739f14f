"""`rayfree node`: run one node of a cluster — the leader with the engine's entry point, or a headless follower.

Every option also comes from the environment (RAYFREE_WORKER, RAYFREE_ENTRY,
RAYFREE_HEADLESS, RAYFREE_WORKER_KWARGS and every RAYFREE_<config field>) and
from a config file (the cluster fields, plus a [node] table with worker,
entry, headless, worker_kwargs), so a compose file can hold the whole invocation.

Exit codes: 0 clean stop (the entry returned 0, the leader shut down, or
SIGTERM); 1 the cluster failed (a node or worker lost, the leader gone); 2 bad
usage; otherwise the entry point's own return value.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, Callable

from rayfree import logs
from rayfree.imports import load_object
from rayfree.cluster.config import ClusterConfig, ConfigError, add_config_arguments, load_config
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
    p.add_argument("--worker-kwargs", metavar="JSON", help="keyword arguments for the worker, as a JSON object "
                   "[RAYFREE_WORKER_KWARGS]")
    p.add_argument("--entry", metavar="PKG.MOD:FUNC", help="node 0: the engine's driver, called with the executor; "
                   "its return value is the exit code [RAYFREE_ENTRY]")
    p.add_argument("--headless", action="store_const", const="1", default=None,
                   help="a follower node: run this node's workers, no driver [RAYFREE_HEADLESS=1]")
    add_security_arguments(p)
    add_config_arguments(p)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", metavar="FILE", help="the cluster secret (`rayfree keygen FILE`) "
                   "[RAYFREE_SECRET_FILE; in docker, the rayfree_secret secret]")
    p.add_argument("--insecure", action="store_true", help="allow plain TCP without a secret, on a trusted "
                   "network only (logged as a warning on every node) [RAYFREE_INSECURE=1]")


def apply_security_arguments(args: argparse.Namespace) -> None:
    """This process's security policy from the flags (else the environment); the executor hands it to every
    worker it starts."""
    from rayfree.transport import security
    security.use(security.resolve(getattr(args, "secret_file", None), True if getattr(args, "insecure", False)
                                  else None))


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
    unknown = set(node) - {"worker", "entry", "headless", "worker_kwargs"}
    if unknown:
        raise NodeUsageError(f"{path}: unknown [node] key(s) {sorted(unknown)}: use worker, entry, headless, "
                             f"worker_kwargs")
    return node


def _load_entry(spec: str) -> Callable[[Any], Any]:
    try:
        obj = load_object(spec, "--entry")
    except ValueError as e:
        raise NodeUsageError(str(e)) from None
    if not callable(obj):
        raise NodeUsageError(f"--entry {spec!r} is not a function")
    return obj


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
        raise NodeUsageError("--worker-kwargs must be a JSON object, e.g. '{\"model\": \"...\"}'")
    headless = (_option(args, "headless", env, file) or "0").strip().lower() in ("1", "true", "yes")
    entry = _option(args, "entry", env, file)
    leader = par.node_rank_within_dp == 0
    if par.nnodes > 1 and par.data_parallel_size > 1:
        raise NodeUsageError("rayfree node runs one DP replica across nodes; data_parallel_size > 1 with several "
                             "nodes is not supported yet: run one replica per set of nodes")
    if par.nnodes > 1:
        from rayfree.transport.security import insecure, process_secret
        if process_secret() is None and not insecure():
            raise NodeUsageError("a multi-node cluster talks over TCP, and rayfree refuses unauthenticated TCP: "
                                 "run `rayfree keygen FILE` once, give every node --secret-file FILE (or "
                                 "RAYFREE_SECRET_FILE; in compose, the rayfree_secret secret), or pass "
                                 "--insecure on a trusted network")
    if leader and headless:
        raise NodeUsageError(f"node_rank={par.node_rank} leads its replica, so it cannot be --headless: give the "
                             f"followers node ranks 1..{par.nnodes - 1}")
    if leader and not entry:
        raise NodeUsageError("node 0 runs the engine: give --entry package.module:function (called with the "
                             "executor), or start this node with --node-rank >= 1 --headless")
    if not leader and entry:
        raise NodeUsageError(f"node {par.node_rank} is a follower: only node 0 runs the entry point; drop --entry "
                             f"(RAYFREE_ENTRY) here")
    return config, worker, kwargs, entry


def run_node(args: argparse.Namespace) -> int:
    logs.configure()
    apply_security_arguments(args)
    try:
        config, worker, kwargs, entry_spec = plan(args)
        entry = _load_entry(entry_spec) if entry_spec else None
    except (NodeUsageError, ConfigError, TransportError) as e:
        print(f"rayfree node: {e}", file=sys.stderr)
        return EXIT_USAGE
    par = config.parallel
    role = "leader" if entry else "follower"
    logger.info("node %d/%d (%s): %d rank(s) from %d, master %s:%d, worker %s", par.node_rank, par.nnodes, role,
                par.local_ranks, par.global_start_rank, par.master_addr, par.master_port, worker)

    def on_signal(signum: int, frame: Any) -> None:
        raise _StopRequested(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    from rayfree.executor.errors import ExecutorError
    from rayfree.executor.multiproc import MultiprocExecutor
    ex: MultiprocExecutor | None = None
    try:
        ex = MultiprocExecutor(config, worker, kwargs)
        if entry is not None:
            rc = entry(ex)
            return rc if isinstance(rc, int) else 0
        logger.info("node %d: %d worker(s) ready; serving the leader until it stops", par.node_rank, par.local_ranks)
        while not ex.wait_done(1.0):
            pass
        if ex.failure is not None:
            logger.error("node %d stopped: %s", par.node_rank, ex.failure)
            return EXIT_FAILED
        return 0
    except _StopRequested as e:
        logger.warning("node %d: %s received; stopping", par.node_rank, e)
        return 0
    except ExecutorError as e:
        logger.error("node %d: %s", par.node_rank, e)
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - start-up errors: print them plainly, not as a crash
        logger.error("node %d: %s: %s", par.node_rank, type(e).__name__, e)
        logger.debug("traceback", exc_info=True)
        return EXIT_FAILED
    finally:
        for s in old:  # the shutdown is bounded by its stages; a second signal must not cut it short
            signal.signal(s, signal.SIG_IGN)
        if ex is not None:
            ex.shutdown()
        for s, h in old.items():
            signal.signal(s, h)

