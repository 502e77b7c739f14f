"""`rayfree node` under torchrun and SkyPilot on two simulated nodes (placed by their variables alone); two
nodes that claim one rank are both told; a node that comes late is waited for, by name, and then joins."""

from __future__ import annotations

import re
import sys

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from tests.support.nodes import NodeProc, shm_files, wait_group_empty
from tests.support.paths import PYTHONPATH

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")

ENV = {
    "PYTHONPATH": PYTHONPATH,
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "RAYFREE_LOG_LEVEL": "INFO",
    "RAYFREE_DEMO_STEPS": "30",
}
#: one command for every node: the launcher says which node this is (node 0 runs the entry, the others not)
NODE = [
    sys.executable, "-m", "rayfree.cli", "node", "--worker", "rayfree.cli.toy_engine:ToyWorker",
    "--entry", "rayfree.cli.demo_driver:drive", "--tp", "2", "--insecure",
]  # fmt: skip


def start(sim: SimulatedCluster, argv_of, env_of) -> list[NodeProc]:
    procs: list[NodeProc] = []
    for k in range(sim.nnodes):
        procs.append(NodeProc(sim.nodes[k], argv_of(k), {**ENV, **env_of(k)}).start())
        procs[-1].others = procs
    return procs


def finished_equal(procs: list[NodeProc], steps: int = 30) -> None:
    procs[0].expect(rf"outputs equal to 1-process model\s+{steps}$", 180)
    for p in procs:
        assert p.wait(60) == 0, p.text()[-3000:] + p.others_text()
        assert not wait_group_empty(p.p.pid, 15) and not shm_files(p.node)


@pytest.mark.timeout(240)
def test_rayfree_node_under_torchrun_one_process_per_node(tmp_path) -> None:
    with SimulatedCluster(2) as sim:
        master = sim.nodes[0].ip

        def argv(k: int) -> list[str]:
            return [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(k), "--master-addr", master, "--master-port", "29500", "--no-python",
                "--log-dir", str(tmp_path / f"torchrun-{k}"), *NODE,
            ]  # fmt: skip

        procs = start(sim, argv, lambda k: {})
        finished_equal(procs)
    text = procs[1].text()
    assert "node placed by torchrun" in text and "GROUP_RANK=1" in text, text[-2000:]
    assert f"master {master}:29501" in text  # torchrun's own store keeps 29500


@pytest.mark.timeout(240)
def test_rayfree_node_under_skypilot() -> None:
    with SimulatedCluster(2) as sim:
        ips = "\n".join(n.ip for n in sim.nodes)
        procs = start(
            sim,
            lambda k: NODE,
            lambda k: {"SKYPILOT_NODE_RANK": str(k), "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": "2",
                       "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": "sky-test"},
        )  # fmt: skip
        finished_equal(procs)
    assert "SKYPILOT_NODE_RANK=1" in procs[1].text() and "node 1/2 (follower)" in procs[1].text()


@pytest.mark.timeout(240)
def test_two_nodes_claiming_one_rank_are_both_told() -> None:
    with SimulatedCluster(3) as sim:
        base = [*NODE[:6], "--tp", "3", "--nnodes", "3", "--master-addr", sim.nodes[0].ip, "--insecure"]
        base[5] = "tests.support.sample_workers:EchoWorker"
        kw = ["--worker-kwargs", '{"distributed": true}', "--join-timeout-s", "120"]
        procs = start(
            sim,
            lambda k: [*base, *kw, "--node-rank", str(min(k, 1)), *(["--entry", "tests.support.multinode_entry:quick"]
                       if k == 0 else ["--headless"])],
            lambda k: {},
        )  # fmt: skip
        codes = [p.wait(90) for p in procs]
    said = [re.search(r"two nodes claim rank 1: node 1 \((\S+)\) and node 1 \((\S+)\)", p.text()) for p in procs]
    assert all(said), "\n=====\n".join(p.text()[-2500:] for p in procs)
    assert {said[0].group(1), said[0].group(2)} == {sim.nodes[1].ip, sim.nodes[2].ip}
    assert all(c != 0 for c in codes), codes


@pytest.mark.timeout(240)
def test_a_late_node_is_waited_for_by_name_and_then_joins() -> None:
    with SimulatedCluster(2) as sim:
        argv = [*NODE[:6], *NODE[8:], "--nnodes", "2", "--master-addr", sim.nodes[0].ip]
        lead = NodeProc(sim.nodes[0], [*argv, "--node-rank", "0", *NODE[6:8]], ENV).start()
        line = lead.expect(r"waiting for node 1 of 2 \(ranks \[1\]\) for (\d+)s of 900s \(join_timeout_s\)", 60)
        follow = NodeProc(sim.nodes[1], [*argv, "--node-rank", "1", "--headless"], ENV).start()  # late, as after a pull
        lead.others = follow.others = [lead, follow]
        finished_equal([lead, follow])
    assert int(line.group(1)) >= 5
