"""Coupled DP replicas (`replica_coupling="coupled"`) on three simulated nodes, DP=3 x TP=1, one replica a node,
the toy model's all-reduce across replicas at every step: replica 2's node is lost and the survivors' groups
across replicas shrink (the same processes, every step checked against the model in one process and against
the members its all-reduce summed); its node started again rejoins and the groups grow back."""

from __future__ import annotations

import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_dp import start
from tests.cluster.test_multinode import FAST, HB_TIMEOUT, SLACK, assert_nothing_left, needs_root
from tests.support.nodes import Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:coupled_steps"
ENV = {
    "RAYFREE_REPLICA_COUPLING": "coupled",
    "RAYFREE_WORKER": "tests.support.coupled_worker:CoupledToyWorker",
    "RAYFREE_ACROSS_REPLICAS_TIMEOUT_S": "5",
}


@pytest.mark.timeout(400)
def test_a_lost_replica_shrinks_the_groups_across_replicas_and_its_rejoin_grows_them() -> None:
    with SimulatedCluster(3) as sim:
        nodes = Nodes(sim, **FAST)
        procs = start(nodes, 3, 3, 1, ENTRY, **ENV)
        for k in range(3):
            procs[k].expect(r"^ACROSS:", 180)
        t_kill = time.monotonic()
        sim.nodes[2].kill()
        shrunk = procs[0].result("SHRUNK", 60)
        everyone = list(procs.values())
        t_back = time.monotonic()
        procs[2] = nodes.start(2, "leader", RAYFREE_NNODES="3", RAYFREE_DATA_PARALLEL_SIZE="3",
                               RAYFREE_TENSOR_PARALLEL_SIZE="1", RAYFREE_PIPELINE_PARALLEL_SIZE="1",
                               RAYFREE_ENTRY=ENTRY, **ENV)  # fmt: skip
        everyone.append(procs[2])
        r2 = procs[2].result("RESULT", 180)
        r0, r1 = procs[0].result("RESULT", 120), procs[1].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    for r in (r0, r1):  # the survivors: every step right, across all three, then two, then all three again
        assert r["steps"] == r["equal"] and [run[0] for run in r["runs"]] == [[0, 1, 2], [0, 1], [0, 1, 2]], r
        assert r["hooks"] == [[1, [0, 1]], [2, [0, 1, 2]]], r["hooks"]  # (the engine's hook, on every rank)
        assert all(c[:2] in ([1, [0, 1]], [2, [0, 1, 2]]) for c in r["changes"]), r["changes"]  # (run again)
        assert r["states"] == {"0": ["serving", 0], "1": ["serving", 0], "2": ["serving", 1]}, r["states"]
        assert r["halves"] == {"dp": True, "ep": True}, r["halves"]  # (a device half of their own: NCCL's place)
    assert r2["epoch"] == 1 and r2["steps"] == r2["equal"] and r2["runs"][-1][0] == [0, 1, 2], r2
    assert [h[1] for h in r2["hooks"]] == [[0, 1, 2]], r2["hooks"]
    assert r2["halves"] == {"dp": True, "ep": True}, r2["halves"]
    assert codes == {0: 0, 1: 0, 2: 0}, codes
    shrink = shrunk["t"] - t_kill
    assert shrink < HB_TIMEOUT + SLACK, f"the survivors' first step over two replicas came {shrink:.2f}s after"
    grow = r0["runs"][2][2] - t_back
    print(f"\nreplica 2 lost: the survivors' first correct step over replicas [0, 1] {shrink:.2f}s after the kill; "
          f"replica 2's node started again: their first over [0, 1, 2] {grow:.2f}s after its start")  # fmt: skip
