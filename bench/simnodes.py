"""What bench/scale.py and bench/soak.py share: a cluster secret for the run, and `rayfree node` started on
each simulated node with the lightest worker that still runs the real executor, queues, gloo and heartbeats.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SECRET: list[str] = []


def secret() -> str:
    """A cluster secret for this run (the streams are sealed, as in production), removed at exit."""
    if not _SECRET:
        from rayfree.transport.secure.policy import write_secret

        d = tempfile.mkdtemp(prefix="rayfree-bench-")
        atexit.register(shutil.rmtree, d, True)
        write_secret(os.path.join(d, "secret"))
        _SECRET.append(os.path.join(d, "secret"))
    return _SECRET[0]


def echo_node_env(sim: Any, k: int, **extra: str) -> dict[str, str]:
    """`rayfree node` k of `sim` (sealed; the echo worker in a gloo world), over `extra`."""
    return {
        "PYTHONPATH": ROOT,
        "RAYFREE_SECRET_FILE": secret(),
        "RAYFREE_NNODES": str(len(sim.nodes)),
        "RAYFREE_NODE_RANK": str(k),
        "RAYFREE_MASTER_ADDR": sim.nodes[0].ip,
        "RAYFREE_MASTER_PORT": "29500",
        "RAYFREE_WORKER": "examples.echo_worker:EchoWorker",
        "RAYFREE_WORKER_KWARGS": '{"distributed": true}',
        "RAYFREE_READY_TIMEOUT_S": "600",
        "RAYFREE_SHUTDOWN_GRACE_S": "2",
        "RAYFREE_SHUTDOWN_TERM_S": "2",
        "RAYFREE_LOG_LEVEL": "WARNING",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        **extra,
    }


def start_nodes(sim: Any, ranks: int, entry: str, **env: str) -> tuple[list[subprocess.Popen], list[list[str]]]:
    """`rayfree node` on every node of `sim` (`ranks` each, TP over all of them; node 0 runs `entry`); the
    processes, and the output lines of each node but node 0 (read by threads; node 0's is the caller's)."""
    n = len(sim.nodes)
    procs = []
    for k in range(n):
        node_env = echo_node_env(sim, k, RAYFREE_TENSOR_PARALLEL_SIZE=str(n * ranks), **env)
        if k == 0:
            node_env["RAYFREE_ENTRY"] = entry
        procs.append(
            sim.nodes[k].popen(
                [sys.executable, "-m", "rayfree.cli", "node"],
                env=node_env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    others: list[list[str]] = [[] for _ in procs[1:]]
    for p, sink in zip(procs[1:], others):
        threading.Thread(target=lambda p=p, sink=sink: sink.extend(p.stdout), daemon=True).start()
    return procs, others


def pair_env(sim: Any, k: int, entry: str, entry_dir: str, base: dict[str, str]) -> dict[str, str]:
    """`rayfree node` k of a two-node cluster on `sim` (one WorkerBase rank each, sealed; node 0 runs `entry`, a
    module in `entry_dir`), over the environment `base`."""
    return {
        **base,
        "PYTHONPATH": f"{ROOT}:{entry_dir}",
        "RAYFREE_SECRET_FILE": secret(),
        "RAYFREE_NNODES": "2",
        "RAYFREE_NODE_RANK": str(k),
        "RAYFREE_MASTER_ADDR": sim.nodes[0].ip,
        "RAYFREE_MASTER_PORT": "29500",
        "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
        "RAYFREE_WORKER": "rayfree.worker.base:WorkerBase",
        **({"RAYFREE_ENTRY": entry} if k == 0 else {"RAYFREE_HEADLESS": "1"}),
    }
