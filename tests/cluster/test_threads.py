"""The threads page (docs/architecture.md, "Threads and who stops them") matches the code: every thread the
supervisors of a running two-node cluster started (node processes and workers) is on it, and what the page says
runs in this shape (relay broadcast, health and metrics ports) runs."""

from __future__ import annotations

import os
import re
import sys

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from tests.support.nodes import ROOT, NodeProc
from tests.support.paths import PYTHONPATH

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")

ENV = {"PYTHONPATH": PYTHONPATH, "TORCH_CPP_LOG_LEVEL": "ERROR", "RAYFREE_LOG_LEVEL": "INFO"}


def documented() -> list[str]:
    """The page's thread names, `<n>` and the like as patterns."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text[text.index("## Threads and who stops them") :]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"^\| `(Rayfree[\w<>-]+)` \|", section, re.M)


def matches(name: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(re.sub(r"<\w+>", r"\\d+", p), name) for p in patterns)


def test_the_page_lists_threads_with_patterns_only_for_numbered_ones() -> None:
    names = documented()
    assert len(names) >= 12 and "RayfreePolicy" in names and "RayfreeRelay-<n>" in names, names
    assert matches("RayfreeRelay-12", names) and not matches("RayfreeRelayX", names)


@pytest.mark.timeout(240)
def test_a_running_two_node_clusters_threads_are_the_pages(tmp_path) -> None:
    with SimulatedCluster(2) as sim:
        procs: list[NodeProc] = []
        for k in range(2):
            role = ["--entry", "tests.support.multinode_entry:threads"] if k == 0 else ["--headless"]
            argv = [
                sys.executable, "-m", "rayfree.cli", "node", "--worker", "tests.support.sample_workers:EchoWorker",
                "--tp", "4", "--nnodes", "2", "--node-rank", str(k), "--master-addr", sim.nodes[0].ip,
                "--insecure", "--health-port", "8495", "--metrics-port", "8496",
                "--worker-kwargs", '{"distributed": true}', *role,
            ]  # fmt: skip
            procs.append(NodeProc(sim.nodes[k], argv, ENV).start())
            procs[-1].others = procs
        seen = procs[0].result("THREADS", 180)
        assert procs[0].wait(60) == 0 and procs[1].wait(60) == 0, procs[0].text()[-3000:] + procs[0].others_text()
    page = documented()
    everything = {n for names in [*seen["nodes"].values(), *seen["workers"].values()] for n in names}
    unknown = sorted(n for n in everything if not matches(n, page))
    assert not unknown, f"threads the page does not list: {unknown}"
    node0, node1 = seen["nodes"]["0"], seen["nodes"]["1"]
    for want in ("RayfreeHeartbeatServer", "RayfreeWorkerMonitor", "RayfreeStallWatch", "RayfreeHealth",
                 "RayfreeMetrics"):  # fmt: skip
        assert want in node0, (want, node0)
    for want in ("RayfreeHeartbeatClient", "RayfreeWorkerMonitor", "RayfreeHealth", "RayfreeMetrics"):
        assert want in node1, (want, node1)
    assert any(re.fullmatch(r"RayfreeRelay-\d+", n) for n in node1), node1  # two ranks there read its relay
    assert all("RayfreeLifeline" in names for names in seen["workers"].values()), seen["workers"]
    print(f"\nthreads: node 0 {node0}; node 1 {node1}; rank 3 {seen['workers']['3']}")
