"""What the benches on simulated nodes share: a cluster secret for the run, `rayfree node` started on each
simulated node with the lightest worker that still runs the real executor, queues, gloo and heartbeats, and
(`NodeRuns`) nodes started, started again and read while they run.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SECRET: list[str] = []


def pythonpath(*first: str) -> str:
    """`first` (default: the checkout), then the caller's PYTHONPATH: prepended, never replaced."""
    from rayfree.testing import prepended_pythonpath

    return prepended_pythonpath(*(first or (ROOT,)))


def secret() -> str:
    """A cluster secret for this run (the streams are sealed, as in production), removed at exit."""
    if not _SECRET:
        from rayfree.transport.secure.policy import write_secret

        d = tempfile.mkdtemp(prefix="rayfree-bench-")
        atexit.register(shutil.rmtree, d, True)
        write_secret(os.path.join(d, "secret"))
        _SECRET.append(os.path.join(d, "secret"))
    return _SECRET[0]


def has_netns(bench: str) -> bool:
    """Network namespaces can be made here, or a line saying exactly what this bench lacks for them."""
    from rayfree.cluster.simulate import netns_missing

    missing = netns_missing()
    if missing:
        print(f"bench/{bench}: simulated nodes need network namespaces; this machine lacks {missing}")
    return not missing


def process_tree(pids: list[int]) -> list[int]:
    """`pids` and every process below them (a simulated node's command runs under its namespace's wrapper)."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def write_json(path: str | None, figures: Any) -> None:
    """The figures into `path` too (--json), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f)


def echo_node_env(sim: Any, k: int, **extra: str) -> dict[str, str]:
    """`rayfree node` k of `sim` (sealed; the echo worker in a gloo world), over `extra`."""
    return {
        "PYTHONPATH": pythonpath(),
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
        "PYTHONPATH": pythonpath(ROOT, entry_dir),
        "RAYFREE_SECRET_FILE": secret(),
        "RAYFREE_NNODES": "2",
        "RAYFREE_NODE_RANK": str(k),
        "RAYFREE_MASTER_ADDR": sim.nodes[0].ip,
        "RAYFREE_MASTER_PORT": "29500",
        "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
        "RAYFREE_WORKER": "rayfree.worker.base:WorkerBase",
        **({"RAYFREE_ENTRY": entry} if k == 0 else {"RAYFREE_HEADLESS": "1"}),
    }


class NodeRuns:
    """`rayfree node` processes on simulated nodes, each one's output lines gathered by a reader thread (the
    failover benches: they start nodes again, and read what each entry says)."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.lock = threading.Lock()
        self.popen: dict[int, subprocess.Popen] = {}
        self.outs: dict[int, list[str]] = {}
        self.readers: dict[int, threading.Thread] = {}
        self.everyone: list[subprocess.Popen] = []

    def launch(self, k: int, env: dict[str, str]) -> None:
        """Start (or start again) node k with `env`."""
        p = self.sim.nodes[k].popen(
            [sys.executable, "-m", "rayfree.cli", "node"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        sink: list[str] = []

        def read() -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                with self.lock:
                    sink.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self.popen[k], self.outs[k], self.readers[k] = p, sink, reader
        self.everyone.append(p)

    def said(self, k: int, tag: str) -> dict | None:
        """The JSON node k's output gave after `tag:`, first time; None if not yet."""
        with self.lock:
            for line in self.outs[k]:
                if line.startswith(tag + ":"):
                    return json.loads(line[len(tag) + 1 :])
        return None

    def waiting(self, k: int, tag: str, match: Callable[[dict], bool], timeout: float) -> bool:
        """Until node k's output gives a `tag:` JSON that `match`es (True), it exits, or `timeout` passes."""
        until = time.monotonic() + timeout
        while time.monotonic() < until and self.popen[k].poll() is None:
            with self.lock:
                said = [json.loads(x[len(tag) + 1 :]) for x in self.outs[k] if x.startswith(tag + ":")]
            if any(match(x) for x in said):
                return True
            time.sleep(0.05)
        return False

    def stepping(self, ks: list[int], since: float) -> float:
        """When the last of these nodes' entries said STEPPING (seconds after `since`)."""
        while not all(self.said(k, "STEPPING") for k in ks):
            if any(self.popen[k].poll() is not None for k in ks) or time.monotonic() > since + 300:
                raise RuntimeError("the nodes did not start:\n" + self.told(ks))
            time.sleep(0.05)
        return max(self.said(k, "STEPPING")["t"] for k in ks) - since  # type: ignore[index]

    def told(self, ks: list[int]) -> str:
        """Each node's exit code (None: still running) and the end of its output (all of it, once it exited)."""
        for k in ks:
            if self.popen[k].poll() is not None:
                self.readers[k].join(5)
        with self.lock:
            return "".join(f"--- node {k} (exit {self.popen[k].poll()}):\n" + "".join(self.outs[k])[-3000:] for k in ks)

    def reap(self) -> None:
        """Every process started, ended (killed after 30 s)."""
        for p in self.everyone:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)


def entry_result(nodes: NodeRuns, k: int, stop: str) -> dict | None:
    """Node k's leader's figures: what its entry wrote to `stop`.<replica>.<pid>.json, named by its RESULT line
    (None: it gave none within 60 s, or within 2 s of leaving: its last lines are read by then)."""
    until = time.monotonic() + 60
    while (r := nodes.said(k, "RESULT")) is None and time.monotonic() < until:
        if nodes.popen[k].poll() is not None:
            until = min(until, time.monotonic() + 2.0)
        time.sleep(0.05)
    if r is None:
        return None
    path = f"{stop}.{r['replica']}.{r['pid']}.json"
    with open(path) as f:
        out: dict = json.load(f)
    os.unlink(path)
    return out


def pct(xs: list[float], q: float) -> float:
    """The `q` quantile of `xs` (nan if empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
