"""Data-parallel replicas across simulated nodes: a broadcast queue per replica, liveness for all; replicas
in one world (one-world) fail together at a lost node, independent ones have a world each (it fails its own).
Coupled replicas (a world each, groups across them that shrink and grow): tests/cluster/test_coupled.py.

Every node runs docker-compose.yml's invocation (head, leader or follower).
In one world, the toy engine all-reduces over the DP group at every step, across
replicas, so a replica missing its cross-replica group, or not stepping, fails
these; independent, each rank's world and DP group must be its replica's own.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rayfree.cluster.config import ParallelConfig
from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_multinode import DETECT, FAST, HB_TIMEOUT, SLACK, assert_nothing_left, needs_root
from tests.support.nodes import NodeProc, Nodes

pytestmark = needs_root


def start(
    nodes: Nodes, nnodes: int, dp: int, tp: int, entry: str, order: str = "leaders first", **env: str
) -> dict[int, NodeProc]:
    """Every node of a DP layout; the first node of each replica leads it (head on node 0, leader elsewhere)."""
    ks = list(range(nnodes)) if order == "leaders first" else list(reversed(range(nnodes)))
    return {k: start_node(nodes, k, nnodes, dp, tp, entry, **env) for k in ks}


def start_node(nodes: Nodes, k: int, nnodes: int, dp: int, tp: int, entry: str, **env: str) -> NodeProc:
    """Node k of a DP layout (`start`'s), started (again) with the command of its service."""
    lead = ParallelConfig(data_parallel_size=dp, nnodes=nnodes).leads(k)
    shape = {
        "RAYFREE_NNODES": str(nnodes),
        "RAYFREE_DATA_PARALLEL_SIZE": str(dp),
        "RAYFREE_TENSOR_PARALLEL_SIZE": str(tp),
        "RAYFREE_PIPELINE_PARALLEL_SIZE": "1",
        **env,
    }
    service = "head" if k == 0 else "leader" if lead else "follower"
    return nodes.start(k, service, **shape, **({"RAYFREE_ENTRY": entry} if lead else {}))


ONE_WORLD = {"RAYFREE_REPLICA_COUPLING": "one-world"}


def check_replica(
    r: dict, replica: int, tp: int, nodes_of: list[int], sim: SimulatedCluster, dp: int, one_world: bool
) -> None:
    assert r["replica"] == replica and r["steps"] == r["equal"] == r["dp_ok"] == 20, r
    want = {"world": tp * dp, "dp": dp} if one_world else {"world": tp, "dp": 1}
    assert [{k: g[k] for k in ("world", "dp")} for g in r["groups"]] == [want] * tp, r["groups"]
    info = sorted(r["info"], key=lambda x: x["rank"])
    assert [x["rank"] for x in info] == list(range(tp)), info
    assert [x["global_rank"] for x in info] == [replica * tp + i for i in range(tp)], info
    for x in info:
        node = nodes_of[x["rank"] * len(nodes_of) // tp]
        assert x["replica"] == replica and x["node"] == node and x["ip"] == sim.nodes[node].ip, x
        relayed = tp // len(nodes_of) > 1  # a follower's lone rank subscribes itself; several read its relay
        assert x["broadcast"] == ("shm" if node == nodes_of[0] else "relay" if relayed else "tcp"), x


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "order,coupling",
    [("leaders first", "one-world"), ("followers first", "one-world"), ("leaders first", "independent")],
)
def test_four_nodes_two_replicas_of_tp2_each_over_two_nodes(order: str, coupling: str) -> None:
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **FAST)
        env = {"RAYFREE_REPLICA_COUPLING": coupling}
        procs = start(nodes, 4, 2, 2, "tests.support.multinode_entry:dp_check", order, **env)
        results = {r: procs[lead].result("RESULT", 180) for r, lead in ((0, 0), (1, 2))}
        for k, p in procs.items():
            assert p.wait(60) == 0, f"node {k}:\n{p.text()[-3000:]}"
        assert_nothing_left(sim, procs.values())
    check_replica(results[0], 0, 2, [0, 1], sim, 2, coupling == "one-world")
    check_replica(results[1], 1, 2, [2, 3], sim, 2, coupling == "one-world")


@pytest.mark.timeout(240)
def test_two_nodes_one_replica_each_independent_by_default() -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        procs = start(nodes, 2, 2, 1, "tests.support.multinode_entry:dp_check", "followers first")
        results = [procs[k].result("RESULT", 180) for k in (0, 1)]
        for k, p in procs.items():
            assert p.wait(60) == 0, f"node {k}:\n{p.text()[-3000:]}"
        assert_nothing_left(sim, procs.values())
    for r in (0, 1):
        check_replica(results[r], r, 1, [r], sim, 2, one_world=False)


@pytest.mark.timeout(240)
def test_one_node_two_replicas_in_one_world_in_one_process() -> None:
    with SimulatedCluster(1) as sim:
        nodes = Nodes(sim, **FAST)
        procs = start(nodes, 1, 2, 2, "tests.support.multinode_entry:dp_check", **ONE_WORLD)
        got = {}
        for _ in range(2):
            r = procs[0].result("RESULT", 180)
            got[r["replica"]] = r
        assert procs[0].wait(60) == 0, procs[0].text()[-3000:]
        assert_nothing_left(sim, procs.values())
    assert sorted(got) == [0, 1]
    for r in (0, 1):
        check_replica(got[r], r, 2, [0], sim, 2, one_world=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [3, 2], ids=["follower-of-replica-1", "leader-of-replica-1"])
def test_a_lost_node_of_replica_1_in_one_world_fails_both_replicas_naming_it(victim: int) -> None:
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **FAST)
        procs = start(nodes, 4, 2, 2, "tests.support.multinode_entry:hang", **ONE_WORLD)
        leaders = [k for k in (0, 2) if k != victim]
        for k in leaders:  # every replica that survives has a call pending on all its ranks
            procs[k].expect(r"^PENDING:", 180)
        if victim == 2:
            procs[2].expect(r"^PENDING:", 180)
        t_kill = time.monotonic()
        sim.nodes[victim].kill()
        results = {k: procs[k].result("RESULT", 30) for k in leaders}
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, procs.values())
    for k, r in results.items():
        took = r["t_fail"] - t_kill
        assert took < HB_TIMEOUT + SLACK, f"replica leader node {k} took {took:.1f}s"
        assert f"node {victim} (" in r["error"] and "DP replica 1" in r["error"], r["error"]
        assert "failed earlier" in r["later"] and r["callbacks"] == 1, r
        print(f"\nnode {victim} killed: replica leader node {k} failed after {took:.2f}s ({r['kind']})")
    assert all(c != 0 for k, c in codes.items() if k != victim), codes


def stepping(sim: SimulatedCluster, **env: str) -> dict[int, NodeProc]:
    """DP=2 x TP=2 on four nodes, independent, both leaders stepping until a replica is lost."""
    procs = start(Nodes(sim, **DETECT), 4, 2, 2, "tests.support.multinode_entry:steps_while_a_replica_is_lost", **env)
    for k in (0, 2):
        procs[k].expect(r"^STEPPING:", 180)
    return procs


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "victim,how",
    [(3, "kill"), (2, "kill"), (3, "stop"), (3, "cut")],
    ids=["follower-of-replica-1", "leader-of-replica-1", "follower-stopped", "follower-link-cut"],
)
def test_a_lost_node_of_independent_replica_1_fails_it_alone(victim: int, how: str) -> None:
    """Replica 0 (nodes 0, 1) serves on through the loss: no call of it fails, its processes stay, it hears of
    replica 1's loss (callback and query) and takes 20 more correct steps; replica 1's surviving node ends its
    calls with ReplicaLost naming the node, and leaves non-zero; replica 0's nodes exit 0 at the end. The node
    is SIGKILLed, SIGSTOPped (past the heartbeats' bound; resumed at the end, it finds itself lost and leaves
    non-zero), or cut off from the network (it loses node 0 and leaves non-zero)."""
    with SimulatedCluster(4) as sim:
        procs = stepping(sim)
        t_kill = time.monotonic()
        if how == "cut":
            sim.nodes[victim].set_link(False)
        else:
            sim.nodes[victim].kill(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        served = procs[0].result("RESULT", 60)
        lost = procs[2].result("RESULT", 60) if victim != 2 else None
        if how == "stop":
            for p in sim.nodes[victim].procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGCONT)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, procs.values())
    assert served["outcome"] == "served" and served["after"] == served["equal"] == 20, served
    assert [k for k, *_ in served["seen"]] == [1] and served["seen"][0][1] == "lost", served["seen"]
    assert f"node {victim}" in served["seen"][0][2], served["seen"]
    assert served["states"]["0"][0] == "serving" and served["states"]["1"][0] == "lost", served["states"]
    heard = served["seen"][0][3] - t_kill
    assert heard < HB_TIMEOUT + SLACK, f"node 0 heard of replica 1's loss after {heard:.2f}s"
    done = {"kill": "killed", "stop": "stopped (SIGSTOP)", "cut": "cut off"}[how]
    print(f"\nnode {victim} {done}: node 0 knew replica 1 lost after {heard:.2f}s, and served on")
    if lost is not None:
        took = lost["t_fail"] - t_kill
        why = f"{lost}\n{procs[2].text()[-6000:]}"
        assert lost["outcome"] == "failed" and lost["replica_lost"] and lost["kind"] == "ReplicaLost", why
        assert lost["lost_dp"] == 1 and lost["lost_node"] == victim and lost["lost_ranks"] == [3], lost
        assert lost["later"] == "ReplicaLost" and took < HB_TIMEOUT + SLACK, (took, lost)
        print(f"node 2 (replica 1's leader) failed its call with ReplicaLost after {took:.2f}s")
    assert codes[0] == codes[1] == 0, codes
    assert all(codes[k] != 0 for k in (2, 3)), codes


@pytest.mark.timeout(240)
def test_node_0_lost_stops_independent_replicas_spread_over_several_nodes() -> None:
    """Without the watch (RAYFREE_WATCH_FANOUT=0; on by default) node 0 is the only watcher of a replica spread over
    several nodes: SIGKILLed, every replica stops (with the watch they serve on: tests/cluster/test_node0_lost.py).
    Replica 1's leader ends its call with LeaderLost (not ReplicaLost) within the heartbeats' bound, and every
    other node leaves non-zero. (Replicas that each run on one node serve on: tests/cluster/test_node0_lost.py.)"""
    with SimulatedCluster(4) as sim:
        procs = stepping(sim, RAYFREE_WATCH_FANOUT="0")
        t_kill = time.monotonic()
        sim.nodes[0].kill()
        r = procs[2].result("RESULT", 60)
        codes = {k: procs[k].wait(60) for k in (1, 2, 3)}
        assert_nothing_left(sim, procs.values())
    assert r["outcome"] == "failed" and r["kind"] == "LeaderLost" and not r["replica_lost"], r
    assert r["later"] == "LeaderLost" and r["t_fail"] - t_kill < HB_TIMEOUT + SLACK, r
    assert all(c != 0 for c in codes.values()), codes
    print(f"\nnode 0 killed: replica 1's leader failed its call with LeaderLost after {r['t_fail'] - t_kill:.2f}s")


@pytest.mark.timeout(240)
def test_nodes_that_disagree_on_how_replicas_are_tied_are_told_so() -> None:
    """Node 0 one-world, node 1 independent (one variable set on one node only): both are told, by the join, in
    one line naming both settings; neither waits for its join timeout."""
    shape = {
        "RAYFREE_NNODES": "2",
        "RAYFREE_DATA_PARALLEL_SIZE": "2",
        "RAYFREE_TENSOR_PARALLEL_SIZE": "1",
        "RAYFREE_PIPELINE_PARALLEL_SIZE": "1",
        "RAYFREE_ENTRY": "tests.support.multinode_entry:dp_check",
    }
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        t0 = time.monotonic()
        procs = {
            1: nodes.start(1, "leader", **shape, RAYFREE_REPLICA_COUPLING="independent"),
            0: nodes.start(0, "head", **shape, RAYFREE_REPLICA_COUPLING="one-world"),
        }
        codes = {k: p.wait(150) for k, p in procs.items()}
        took = time.monotonic() - t0
        assert_nothing_left(sim, procs.values())
    assert all(c != 0 for c in codes.values()), codes
    for k, p in procs.items():
        text = p.text()
        assert "disagree on the cluster's shape" in text, f"node {k}:\n{text[-3000:]}"
        assert "replicas=one-world" in text and "replicas=independent" in text, f"node {k}:\n{text[-3000:]}"
    # (far under the join timeout, 900 s: two cold starts, which took 75 s beside a second suite in CI on 2e760a1)
    assert took < 150, took
