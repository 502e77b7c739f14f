"""Run docker-compose.yml's node invocations on simulated nodes, and watch their output.

`compose_invocation(service, values)` reads the service's command and
environment from docker-compose.yml (interpolating ${VAR:-default} from
`values`), so the multi-node tests run exactly what the compose file runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import yaml

from rayfree.cluster.simulate import SimulatedCluster, SimulatedNode
from rayfree.procs import group_members
from rayfree.testing import NodeRun
from tests.support.paths import PYTHONPATH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(ROOT, "docker-compose.yml")
#: The simulated nodes' start-up bound (RAYFREE_READY_TIMEOUT_S), far over a quiet start: the tests are about what
#: comes after it. Beside another suite, two tests each started a node whose four workers were still importing
#: torch after 60 s (both suites reached the same test at once: dozens of processes importing torch on two cores).
READY_TIMEOUT_S = "150"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*)|:\?([^}]*))?\}")


def compose() -> dict[str, Any]:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} (and ${VAR:?msg}, taken as required)."""

    def sub(m: re.Match) -> str:
        if m.group(1) in values:
            return values[m.group(1)]
        if m.group(2) is None:
            raise KeyError(f"docker-compose.yml needs {m.group(1)}" + (f": {m.group(3)}" if m.group(3) else ""))
        return m.group(2)

    return _VAR.sub(sub, text)


def compose_invocation(service: str, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a compose service; `rayfree` becomes this interpreter's `-m rayfree.cli`."""
    svc = compose()["services"][service]
    command = [interpolate(str(c), values) for c in svc["command"]]
    assert command[0] == "rayfree", f"{service}: command should start with rayfree, got {command}"
    env = {k: interpolate(str(v), values) for k, v in (svc.get("environment") or {}).items()}
    return [sys.executable, "-m", "rayfree.cli", *command[1:]], env


class NodeProc(NodeRun):
    """A `rayfree node` process on a simulated node (rayfree.testing's, run from the repository); its failures
    show the other nodes' output too."""

    def __init__(self, node: SimulatedNode, argv: list[str], env: dict[str, str]) -> None:
        self.others: list[NodeProc] = []  # the other nodes: their output goes into failure messages too
        super().__init__(node, argv, env, ROOT)

    @property
    def p(self) -> subprocess.Popen:
        return self.proc

    def context(self) -> str:
        return self.others_text()

    def result(self, tag: str, timeout: float) -> dict:
        """The JSON after `tag:` on a line."""
        return self.json_after(tag, timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {self.node.index} still running after {timeout}s:\n" + self.text()[-4000:]
            ) from None

    def others_text(self) -> str:
        return "".join(
            f"\n--- node {o.node.index} (exit {o.p.poll()}) ---\n{o.text()[-3000:]}"
            for o in self.others
            if o is not self
        )


class Nodes:
    """Start compose services on a SimulatedCluster's nodes, with the test's address, ports and overrides."""

    def __init__(self, sim: SimulatedCluster, **env: str) -> None:
        self.sim = sim
        master = sim.nodes[0].ip
        if sim.mode == "netns":
            port, hb = 29500, 29501
        else:
            from rayfree.transport import get_open_port

            port, hb = get_open_port("127.0.0.1"), get_open_port("127.0.0.1")
        self.values = {"RAYFREE_MASTER_ADDR": master, "RAYFREE_MASTER_PORT": str(port)}
        self.env = {
            "PYTHONPATH": PYTHONPATH,
            "RAYFREE_HEARTBEAT_PORT": str(hb),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            "RAYFREE_LOG_LEVEL": "INFO",
            **env,
        }
        self.started: list[NodeProc] = []

    def start(self, k: int, service: str | None = None, **env: str) -> NodeProc:
        """Node k as compose's `service` (default: head for node 0, follower for the others)."""
        service = service or ("head" if k == 0 else "follower")
        argv, cenv = compose_invocation(service, {**self.values, "RAYFREE_NODE_RANK": str(k)})
        proc = NodeProc(self.sim.nodes[k], argv, {**cenv, **self.env, **env}).start()
        self.started.append(proc)
        proc.others = self.started
        return proc


def until_unready(p: NodeProc, node: NodeProc, timeout: float) -> tuple[float, str]:
    """When a node that leaves by itself stopped being ready, and why. It answers 503 while it shuts down, but
    a node with one worker may be gone between two polls on a loaded machine (CI saw node 0 go in 160 ms); to a
    kubelet or a load balancer a closed port is "not ready" too, and the node's own last words then say why."""
    m = p.expect(r"^PROBE (503|0) (\S+) (.*)$", timeout)
    if m.group(1) == "503":
        return float(m.group(2)), json.loads(m.group(3))["reason"]
    node.wait(30)
    return float(m.group(2)), node.text()


def wait_group_empty(pgid: int, timeout: float) -> list[int]:
    """Poll until no process is left in the group (bounded); returns what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def shm_files(node: SimulatedNode) -> list[str]:
    d = node.shm_dir
    return sorted(f for f in os.listdir(d) if f.startswith("rayfree-")) if d and os.path.isdir(d) else []
