"""Coupled DP replicas (`replica_coupling="coupled"`) on two simulated nodes, DP=2 x TP=2, one replica a node,
the toy model's all-reduce across replicas at every step: replica 1's node is lost and the survivor's groups
across replicas shrink to a group of one (the same processes, every step checked against the model in one
process and against the members its all-reduce summed); its node started again rejoins and the groups grow
back. At start, after the shrink, after the grow and in the rejoined replica, every rank checks every group
the docs show, both halves, as the docs use them: with TP=2, a DP group of one that torch read as the default
group would sum across TP instead (the replica's own world)."""

from __future__ import annotations

import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_dp import start
from tests.cluster.test_multinode import HB_TIMEOUT, LONG_BOUNDS, SLACK, assert_nothing_left, needs_root
from tests.support.nodes import NodeProc, Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:coupled_steps"
ENV = {
    "RAYFREE_REPLICA_COUPLING": "coupled",
    "RAYFREE_WORKER": "tests.support.coupled_worker:CoupledToyWorker",
    "RAYFREE_ACROSS_REPLICAS_TIMEOUT_S": "5",
}


def restart(nodes: Nodes, k: int) -> NodeProc:
    """Node k of the two-node coupled layout (DP=2 x TP=2, one replica a node), started again."""
    return nodes.start(k, "leader", RAYFREE_NNODES="2", RAYFREE_DATA_PARALLEL_SIZE="2",
                       RAYFREE_TENSOR_PARALLEL_SIZE="2", RAYFREE_PIPELINE_PARALLEL_SIZE="1", RAYFREE_ENTRY=ENTRY,
                       **ENV)  # fmt: skip


@pytest.mark.timeout(400)
def test_a_lost_replica_shrinks_the_groups_across_replicas_and_its_rejoin_grows_them() -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **LONG_BOUNDS)
        procs = start(nodes, 2, 2, 2, ENTRY, **ENV)
        for k in range(2):
            procs[k].expect(r"^ACROSS:", 180)
        t_kill = time.monotonic()
        sim.nodes[1].kill()
        shrunk = procs[0].result("SHRUNK", 60)
        everyone = list(procs.values())
        t_back = time.monotonic()
        procs[1] = restart(nodes, 1)
        everyone.append(procs[1])
        r1 = procs[1].result("RESULT", 180)
        r0 = procs[0].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    # the survivor: every step right, across both, then itself alone (a group of one), then both again
    assert r0["steps"] == r0["equal"] and [run[0] for run in r0["runs"]] == [[0, 1], [0], [0, 1]], r0
    assert r0["hooks"] == [[1, [0]], [2, [0, 1]]], r0["hooks"]  # (the engine's hook)
    assert all(c[:2] in ([1, [0]], [2, [0, 1]]) for c in r0["changes"]), r0["changes"]  # (run again)
    assert r0["states"] == {"0": ["serving", 0], "1": ["serving", 1]}, r0["states"]
    assert r0["halves"] == {"dp": True, "ep": True}, r0["halves"]  # (a device half of their own: NCCL's place)
    # every group right on both TP ranks: at start (DP [0, 1]), after the shrink ([0]) and after the grow
    assert [[c["dp"] for c in rank] for rank in r0["checks"]] == [[[0, 2], [0], [0, 2]], [[1, 3], [1], [1, 3]]]
    assert [c["wrong"] for rank in r0["checks"] for c in rank] == [[]] * 6, r0["checks"]
    # the rejoined replica: no step before its first membership, every one across both replicas
    assert r1["epoch"] == 1 and r1["steps"] == r1["equal"] and [run[0] for run in r1["runs"]] == [[0, 1]], r1
    assert [h[1] for h in r1["hooks"]] == [[0, 1]], r1["hooks"]
    assert r1["halves"] == {"dp": True, "ep": True}, r1["halves"]
    assert [[c["dp"] for c in rank] for rank in r1["checks"]] == [[[0, 2]], [[1, 3]]], r1["checks"]
    assert [c["wrong"] for rank in r1["checks"] for c in rank] == [[], []], r1["checks"]
    assert codes == {0: 0, 1: 0}, codes
    shrink = shrunk["t"] - t_kill
    assert shrink < HB_TIMEOUT + SLACK, f"the survivors' first step over two replicas came {shrink:.2f}s after"
    grow = r0["runs"][2][2] - t_back
    print(f"\nreplica 1 lost: the survivor's first correct step over replica [0] {shrink:.2f}s after the kill; "
          f"replica 1's node started again: its first over [0, 1] {grow:.2f}s after its start")  # fmt: skip
