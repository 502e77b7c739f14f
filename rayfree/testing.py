"""Your engine on N simulated nodes, from your own tests: `simulated_cluster` and the `rayfree_cluster` fixture.

Each node is a network namespace of this machine with its own address and
its own /dev/shm (as root; otherwise every node shares loopback and ranks are
forced remote, and a warning says so), running `rayfree node` with your
worker class and, on the node that leads each replica, your entry point, as
a real cluster would. The cluster gets a secret of its own (its TCP traffic
is sealed as in production); everything it started and made (processes,
namespaces, mounts, the secret) is removed on exit, also when the test fails.

    from rayfree.testing import simulated_cluster

    def test_my_engine_on_two_nodes():
        with simulated_cluster(2, worker="my_engine.worker:Worker", entry="my_engine.serve:main", tp=2) as c:
            assert c.wait(timeout=300) == [0, 0], c.output()
            assert "served 20 requests" in c.nodes[0].text()

In pytest, `pytest_plugins = ["rayfree.testing"]` in a conftest.py gives the
`rayfree_cluster` fixture: a function with `simulated_cluster`'s arguments
whose clusters are torn down after the test. docs/testing.md has the whole
page; examples/test_simulated_cluster.py is a worked example.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from rayfree.cluster.config import ParallelConfig
from rayfree.cluster.simulate import SimulatedCluster, SimulatedNode
from rayfree.supervisor import supervisor
from rayfree.transport.net import get_open_port
from rayfree.transport.secure.policy import write_secret

__all__ = ["simulated_cluster", "SimulatedRun", "NodeRun", "rayfree_cluster", "prepended_pythonpath"]


def prepended_pythonpath(*first: str) -> str:
    """`first`, then this process's PYTHONPATH: what a child started from a test needs (its dependencies may
    come from PYTHONPATH: a `pip install --target` directory, an HPC module system). Prepend; never replace."""
    parts = [*first, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


_Run = TypeVar("_Run", bound="NodeRun")


class NodeRun:
    """One node's `rayfree node` process; its output (stdout and stderr merged) read line by line. Built, then
    `start()`ed: the process and the thread that reads it begin there."""

    def __init__(self, node: SimulatedNode, argv: list[str], env: dict[str, str], cwd: str | None) -> None:
        self.node = node
        self.index = node.index
        self.ip = node.ip
        #: the lines not yet looked at by `expect` (None: it exited), and every line so far
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self._launch = (argv, env, cwd)
        self._drained = False

    def start(self: _Run) -> _Run:
        """Start the node's process and the thread that reads its output."""
        argv, env, cwd = self._launch
        node = self.node
        self.proc = node.popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = supervisor().start(f"RayfreeTestNode-{node.index}", self._read)
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def context(self) -> str:
        """More text for a failure's message (the other nodes' output, say); none here."""
        return ""

    @property
    def returncode(self) -> int | None:
        """Its exit code (None while it runs)."""
        return self.proc.poll()

    def text(self) -> str:
        """Everything it printed so far (once it has exited: all of it, read to the end of its output)."""
        if self.proc.poll() is not None and self._reader.alive() and not self._drained:
            self._drained = True  # (bounded, once: a child it left may hold its output open)
            self._reader.wait(5)
        return "".join(self.output)

    def expect(self, pattern: str, timeout: float) -> re.Match[str]:
        """The next line it prints that matches `pattern` (a regular expression); AssertionError with its output
        if none comes within `timeout` seconds or it exits first."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"node {self.index}: no line matching {pattern!r} within {timeout}s:\n{self.text()[-4000:]}"
                    + self.context()
                ) from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(
                    f"node {self.index} exited ({self.returncode}) without a line matching {pattern!r}:\n"
                    + self.text()[-4000:]
                    + self.context()
                )
            m = rx.search(line)
            if m:
                return m

    def json_after(self, tag: str, timeout: float) -> Any:
        """The JSON an entry printed after `tag:` at the start of a line (say `print("RESULT:" + json.dumps(x))`)."""
        return json.loads(self.expect(rf"^{re.escape(tag)}:(.*)$", timeout).group(1))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process of this node (SIGKILL: the node is lost)."""
        self.node.kill(sig)


class SimulatedRun:
    """A running simulated cluster of `rayfree node` processes (see the module docstring)."""

    def __init__(self, sim: SimulatedCluster, nodes: list[NodeRun], secret_dir: str) -> None:
        self.sim = sim
        self.nodes = nodes
        self._secret_dir = secret_dir
        #: how each node was started (argv, environment, directory), for `restart`
        self._launch: dict[int, tuple[list[str], dict[str, str], str | None]] = {}
        self._retired: list[NodeRun] = []

    def restart(
        self, k: int, *, timeout: float = 60.0, env: dict[str, str] | None = None, args: Sequence[str] = ()
    ) -> NodeRun:
        """Start node `k` again with the command it was started with (plus `env` and `args`), as its launcher
        would after a loss: a lost DP replica's node rejoins this way (docs/operations.md). Its earlier process
        must have exited (or been killed, `NodeRun.kill`) within `timeout` seconds; the new one replaces it in
        `nodes` and is returned (its output starts empty)."""
        old = self.nodes[k]
        try:
            old.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {k} still running after {timeout}s: stop it before restarting it") from None
        argv, own, cwd = self._launch[k]
        self._retired.append(old)
        self.nodes[k] = NodeRun(self.sim.nodes[k], [*argv, *args], {**own, **(env or {})}, cwd).start()
        return self.nodes[k]

    def wait(self, timeout: float) -> list[int]:
        """Every node's exit code, once all have exited; AssertionError naming the nodes still running (and
        their output) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            try:
                n.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [m.index for m in self.nodes if m.returncode is None]
                raise AssertionError(f"node(s) {running} still running after {timeout}s:\n{self.output()}") from None
        return [int(n.proc.returncode) for n in self.nodes]

    def output(self, tail: int = 3000) -> str:
        """Every node's output, the last `tail` characters of each."""
        return "\n".join(f"--- node {n.index} (exit {n.returncode}) ---\n{n.text()[-tail:]}" for n in self.nodes)

    def close(self) -> None:
        self.sim.close()  # kills what is left, removes the namespaces and mounts
        for n in [*self.nodes, *self._retired]:
            if n.proc.stdout is not None:
                n.proc.stdout.close()
        shutil.rmtree(self._secret_dir, ignore_errors=True)


@contextlib.contextmanager
def simulated_cluster(
    nnodes: int,
    *,
    worker: str,
    entry: str,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    worker_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    cwd: str | None = None,
    pythonpath: Sequence[str] = (),
    node_env: dict[int, dict[str, str]] | None = None,
) -> Iterator[SimulatedRun]:
    """Start `rayfree node` on `nnodes` simulated nodes and yield the running cluster; remove everything on exit.

    Args:
        nnodes: how many nodes.
        worker: your worker class, ``"pkg.mod:Class"``; it must import on every node, that is from `cwd` or a
            `pythonpath` entry (the nodes are new processes: a class defined in a test file is not there).
        entry: your engine's driver, ``"pkg.mod:func"`` (called with the executor on each replica's first node).
        tp, pp, dp: the cluster's shape (tensor, pipeline and data parallel sizes).
        worker_kwargs: keyword arguments for the worker's constructor (JSON).
        env: more environment for every node (RAYFREE_* settings, your engine's own).
        args: more `rayfree node` options for every node (say ``["--health-port", "8000"]``).
        cwd: where the nodes run (default: this process's directory); it is put first on their PYTHONPATH.
        pythonpath: more directories on the nodes' PYTHONPATH.
        node_env: more environment for one node alone, by node rank (its devices, say).
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    cwd = os.path.abspath(cwd or os.getcwd())
    secret_dir = tempfile.mkdtemp(prefix="rayfree-test-secret-")
    secret = os.path.join(secret_dir, "secret")
    write_secret(secret)
    sim = SimulatedCluster(nnodes)
    sim.__enter__()
    nodes: list[NodeRun] = []
    run = SimulatedRun(sim, nodes, secret_dir)
    try:
        if sim.mode == "netns":
            port, hb = 29500, 29501  # every node has a network of its own
        else:
            port, hb = get_open_port("127.0.0.1"), get_open_port("127.0.0.1")
        layout = ParallelConfig(data_parallel_size=dp, nnodes=nnodes)
        path = prepended_pythonpath(cwd, *map(os.path.abspath, pythonpath))
        for k, node in enumerate(sim.nodes):
            argv = [
                sys.executable, "-m", "rayfree.cli", "node", "--nnodes", str(nnodes), "--node-rank", str(k),
                "--master-addr", sim.nodes[0].ip, "--master-port", str(port), "--heartbeat-port", str(hb),
                "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--worker", worker, "--secret-file", secret,
                "--launcher", "none", *(["--entry", entry] if layout.leads(k) else ["--headless"]), *args,
            ]  # fmt: skip
            if worker_kwargs:
                argv += ["--worker-kwargs", json.dumps(worker_kwargs)]
            own = {"PYTHONPATH": path, "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {}), **(node_env or {}).get(k, {})}
            run._launch[k] = (argv, own, cwd)
            nodes.append(NodeRun(node, argv, own, cwd).start())
        yield run
    finally:
        run.close()


def _fixture() -> Any:
    import pytest

    @pytest.fixture
    def rayfree_cluster() -> Iterator[Any]:
        """`simulated_cluster`'s arguments in, a running `SimulatedRun` out; every cluster made in the test is
        removed when it ends."""
        with contextlib.ExitStack() as stack:
            yield lambda nnodes, **kw: stack.enter_context(simulated_cluster(nnodes, **kw))

    return rayfree_cluster


try:  # a pytest plugin: `pytest_plugins = ["rayfree.testing"]` in a conftest.py
    rayfree_cluster = _fixture()
except ImportError:  # no pytest here: the context manager alone
    pass
