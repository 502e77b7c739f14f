"""`rayfree scale --dp N`: an operator narrows a running cluster of DP replicas and widens it again, on simulated
nodes, while replica 0 serves throughout: independent replicas (four nodes, DP=2 x TP=2; replica 1 on nodes 2
and 3), and coupled ones stepping together (two nodes, one replica each), whose groups across replicas shrink
and grow with the width. Past the width the cluster started with, replica 0's engine asks (`scale_replicas`).
Scaling in is a drain of the highest replicas (the roster's, executor/roster.py); scaling out again admits
their nodes started with the same command, as a rejoin."""

from __future__ import annotations

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_coupled import ENTRY as COUPLED_ENTRY
from tests.cluster.test_coupled import ENV as COUPLED_ENV
from tests.cluster.test_coupled import restart as restart_coupled
from tests.cluster.test_dp import start
from tests.cluster.test_drain import rayfree
from tests.cluster.test_multinode import LONG_BOUNDS, assert_nothing_left, needs_root
from tests.cluster.test_rejoin import restart
from tests.support.nodes import NodeProc, Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_through_drain"


def stepping(
    sim: SimulatedCluster, nnodes: int, dp: int, tp: int, entry: str, leaders: tuple[int, ...], **env: str
) -> tuple[Nodes, dict[int, NodeProc]]:
    """The layout started as test_dp.start starts it, once the replicas' leaders on `leaders` step."""
    nodes = Nodes(sim, **LONG_BOUNDS)
    procs = start(nodes, nnodes, dp, tp, entry, **env)
    for k in leaders:
        procs[k].expect(r"^STEPPING:", 180)
    return nodes, procs


@pytest.mark.timeout(400)
def test_scale_in_drains_the_highest_replica_and_scale_out_takes_it_back_while_replica_0_serves_on() -> None:
    with SimulatedCluster(4) as sim:
        nodes, procs = stepping(sim, 4, 2, 2, ENTRY, (0, 2))
        zero = rayfree(sim, nodes, 1, "scale", "--dp", "0")
        narrower = rayfree(sim, nodes, 1, "scale", "--dp", "1")
        r1 = procs[2].result("RESULT", 120)
        codes = {k: procs[k].wait(60) for k in (2, 3)}  # drained: they stop cleanly
        everyone = list(procs.values())
        early = restart(nodes, 2)  # started again before the width is back: refused, in one line
        everyone.append(early)
        early_code = early.wait(120)
        refused = procs[0].expect(r"node 2 \(pid \d+\) runs DP replica\(s\) \[1\], past the requested width 1.*", 30)
        status = rayfree(sim, nodes, 1, "status")
        wider = rayfree(sim, nodes, 1, "scale", "--dp", "2")
        procs[2], procs[3] = restart(nodes, 2), restart(nodes, 3)
        everyone += [procs[2], procs[3]]
        back = procs[2].result("RESULT", 180)
        r0 = procs[0].result("RESULT", 120)
        codes.update({k: p.wait(60) for k, p in procs.items()})
        assert_nothing_left(sim, everyone)
    assert zero.returncode == 2 and zero.stderr.count("\n") == 1 and "must be a whole number >= 1" in zero.stderr, zero
    assert narrower.returncode == 0 and "DP width 2 -> 1: replicas [1] drain" in narrower.stdout, narrower
    assert r1["outcome"] == "drained" and r1["steps"] == r1["equal"] > 0, r1  # every step it began finished right
    assert [s[1] for s in r1["seen"]] == ["draining", "drained"], r1["seen"]
    assert early_code == 2 and "past the requested width 1" in early.text(), early.text()[-3000:]
    assert refused.group(0).endswith("refused"), refused.group(0)
    assert "width 1 serving of 1 requested" in status.stdout and "replica 1: drained, epoch 0" in status.stdout
    assert wider.returncode == 0 and "DP width 1 -> 2: start node(s) [2, 3] for replica(s) [1]" in wider.stdout
    assert (back["epoch"], back["outcome"], back["equal"]) == (1, "served", 20), back
    assert [s[:2] for s in r0["seen"]] == [[1, "draining"], [1, "drained"], [1, "serving"]], r0["seen"]
    assert r0["equal"] == r0["steps"] and r0["states"] == {"0": ["serving", 0], "1": ["serving", 1]}, r0
    assert r0["widths"][:2] == [2, 2] and r0["widths"][2] >= 2, r0  # (the engine's query: requested, serving, epoch)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, codes


@pytest.mark.timeout(400)
def test_coupled_replicas_scale_in_and_out_by_command_while_they_step() -> None:
    """DP=2 x TP=2 coupled, one replica a node, every step checked (the output against the model in one process,
    the members its sum across replicas names): `rayfree scale --dp 1` drains replica 1 (its step under way is cut
    short, its node exits 0) and replica 0's groups across replicas shrink to itself; `--dp 2` and node 1 started
    again with the same command: they grow back. Replica 0 keeps its processes and fails no step."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **LONG_BOUNDS)
        procs = start(nodes, 2, 2, 2, COUPLED_ENTRY, **COUPLED_ENV)
        for k in range(2):
            procs[k].expect(r"^ACROSS:", 180)
        narrower = rayfree(sim, nodes, 0, "scale", "--dp", "1")
        r1 = procs[1].result("RESULT", 120)
        code1 = procs[1].wait(60)
        procs[0].result("SHRUNK", 60)
        status = rayfree(sim, nodes, 0, "status")
        wider = rayfree(sim, nodes, 0, "scale", "--dp", "2")
        everyone = list(procs.values())
        procs[1] = restart_coupled(nodes, 1)
        everyone.append(procs[1])
        back = procs[1].result("RESULT", 180)
        r0 = procs[0].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    assert narrower.returncode == 0 and "DP width 2 -> 1: replicas [1] drain" in narrower.stdout, narrower
    assert r1["outcome"] == "drained" and r1["steps"] == r1["equal"] > 0 and code1 == 0, (r1, code1)
    assert "operator" in r1["refused"], r1["refused"]  # (its drain under way, or done: both say who asked)
    assert "width 1 serving of 1 requested" in status.stdout and "replica 1: drained, epoch 0" in status.stdout
    assert wider.returncode == 0 and "DP width 1 -> 2: start node(s) [1] for replica(s) [1]" in wider.stdout
    assert r0["steps"] == r0["equal"] and [run[0] for run in r0["runs"]] == [[0, 1], [0], [0, 1]], r0
    assert r0["hooks"] == [[1, [0]], [2, [0, 1]]], r0["hooks"]  # (the engine's hook, at each width)
    assert all(c[:2] in ([1, [0]], [2, [0, 1]]) for c in r0["changes"]), r0["changes"]  # (run again)
    assert r0["states"] == {"0": ["serving", 0], "1": ["serving", 1]}, r0["states"]
    assert [c["wrong"] for rank in r0["checks"] for c in rank] == [[]] * 6, r0["checks"]
    assert back["epoch"] == 1 and back["steps"] == back["equal"] and [run[0] for run in back["runs"]] == [[0, 1]]
    assert codes == {0: 0, 1: 0}, codes


WIDENING = "tests.support.multinode_entry:widening"
COUPLED_WIDENING = "tests.support.multinode_entry:coupled_widening"


def widened(nodes: Nodes, k: int, width: int, entry: str = WIDENING, **env: str) -> NodeProc:
    """Node k of a cluster of one TP=1 replica a node, started with the cluster's command but --dp and --nnodes
    raised to `width` (how a scale-out past --dp starts its new nodes)."""
    return nodes.start(k, "leader", RAYFREE_NNODES=str(width), RAYFREE_DATA_PARALLEL_SIZE=str(width),
                       RAYFREE_TENSOR_PARALLEL_SIZE="1", RAYFREE_PIPELINE_PARALLEL_SIZE="1", RAYFREE_ENTRY=entry,
                       **env)  # fmt: skip


def ask(path, width: int, proc: NodeProc) -> str:
    """Replica 0's engine (on `proc`) asks for `width` (`scale_replicas`, EngineScales); its answer."""
    path.write_text(str(width))
    return proc.result("ASKED", 60)["answer"]


@pytest.mark.timeout(400)
def test_replica_0s_engine_scales_out_past_the_width_the_cluster_started_with_and_back_while_the_others_serve(
    tmp_path,
) -> None:
    """Independent DP=2 x TP=1 on two nodes, both leaders stepping: replica 0's engine asks for width 3
    (`scale_replicas`) and a third node is started with --dp 3 --nnodes 3: node 0 admits it (replica 2, in epoch
    1: it had no first start), every node hears it serve, and it steps; then the engine asks for width 2: replica
    2 drains and its node exits 0. A node started for a replica past the requested width (--dp 4 --nnodes 4,
    node 3) is refused in one line and exits 2, changing nothing. Replicas 0 and 1 fail no step and keep their
    processes. (`rayfree scale` asks node 0 the same: the test above.)"""
    with SimulatedCluster(4) as sim:
        width = tmp_path / "width"
        nodes, procs = stepping(sim, 2, 2, 1, WIDENING, (0, 1), RF_ENGINE_SCALES=str(width))
        wider = ask(width, 3, procs[0])
        procs[2] = widened(nodes, 2, 3)
        far = widened(nodes, 3, 4)
        far_code = far.wait(120)
        for k in (0, 1):
            procs[k].expect(r'^HEARD:.*"replica": 2, "state": "serving"', 180)
        procs[2].expect(r"^STEPPED:", 60)
        status = rayfree(sim, nodes, 1, "status")
        narrower = ask(width, 2, procs[0])
        r2 = procs[2].result("RESULT", 120)
        results = {k: procs[k].result("RESULT", 120) for k in (0, 1)}
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, [*procs.values(), far])
    assert wider.startswith("DP width 2 -> 3: start node(s) [2] for replica(s) [2] with"), wider
    assert far_code == 2 and "past the requested width 3" in far.text(), far.text()[-3000:]
    assert "width 3 serving of 3 requested" in status.stdout and "replica 2: serving, epoch 1" in status.stdout, (
        status.stdout
    )
    assert "cluster: 3 node(s) (started as tp=1 pp=1 pcp=1 dp=2 nnodes=2" in status.stdout, status.stdout
    assert narrower == "DP width 3 -> 2: replicas [2] drain, then their nodes exit 0", narrower
    assert (r2["epoch"], r2["outcome"]) == (1, "drained") and r2["steps"] == r2["equal"] >= 10, r2
    for k, r in results.items():
        assert r["outcome"] == "served" and r["steps"] == r["equal"] > 10, (k, r)
        assert [s[:2] for s in r["seen"]] == [[2, "serving"], [2, "draining"], [2, "drained"]], (k, r["seen"])
        assert r["states"] == {"0": ["serving", 0], "1": ["serving", 0], "2": ["drained", 1]}, (k, r["states"])
    assert results[0]["widths"][:2] == [2, 2], results[0]["widths"]
    assert codes == {0: 0, 1: 0, 2: 0}, codes


@pytest.mark.timeout(400)
def test_coupled_replicas_scale_out_past_the_width_they_started_with_and_back_from_the_engine_while_they_step(
    tmp_path,
) -> None:
    """Coupled DP=2 x TP=1 on two nodes, stepping together, every step checked: replica 0's engine asks for width
    3 (`scale_replicas`) and a third node is started with --dp 3 --nnodes 3: replica 2 joins in epoch 1 and the
    groups across replicas grow to [0, 1, 2] (each survivor's hook says so); the engine asks for 2: replica 2
    drains, its node exits 0, and the groups shrink back to [0, 1]. Replicas 0 and 1 fail no step: a step that
    met a change ran again (ReplicasChanged)."""
    with SimulatedCluster(3) as sim:
        width = tmp_path / "width"
        nodes, procs = stepping(sim, 2, 2, 1, COUPLED_WIDENING, (0, 1), RF_ENGINE_SCALES=str(width), **COUPLED_ENV)
        wider = ask(width, 3, procs[0])
        procs[2] = widened(nodes, 2, 3, COUPLED_WIDENING, **COUPLED_ENV)
        for k in (0, 1, 2):
            procs[k].expect(r'^MEMBERS:.*"members": \[0, 1, 2\]', 180)
        narrower = ask(width, 2, procs[0])
        r2 = procs[2].result("RESULT", 120)
        results = {k: procs[k].result("RESULT", 120) for k in (0, 1)}
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, list(procs.values()))
    assert wider.startswith("DP width 2 -> 3: start node(s) [2] for replica(s) [2] with"), wider
    assert narrower == "DP width 3 -> 2: replicas [2] drain, then their nodes exit 0", narrower
    assert (r2["epoch"], r2["outcome"]) == (1, "drained") and r2["steps"] == r2["equal"] > 0, r2
    assert [run[0] for run in r2["runs"]] == [[0, 1, 2]], r2["runs"]
    for k, r in results.items():
        assert r["steps"] == r["equal"] and [run[0] for run in r["runs"]] == [[0, 1], [0, 1, 2], [0, 1]], (k, r)
        assert r["hooks"] == [[1, [0, 1, 2]], [2, [0, 1]]], (k, r["hooks"])
        assert all(c in ([1, [0, 1, 2]], [2, [0, 1]]) for c in r["changes"]), (k, r["changes"])
    assert codes == {0: 0, 1: 0, 2: 0}, codes
