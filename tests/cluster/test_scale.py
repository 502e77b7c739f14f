"""`rayfree scale --dp N`: an operator narrows a running cluster of DP replicas and widens it again, on simulated
nodes, while replica 0 serves throughout: independent replicas (four nodes, DP=2 x TP=2; replica 1 on nodes 2
and 3), and coupled ones stepping together (two nodes, one replica each), whose groups across replicas shrink
and grow with the width. Scaling in is a drain of the highest replicas (the roster's, executor/roster.py);
scaling out again admits their nodes started with the same command, as a rejoin."""

from __future__ import annotations

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_coupled import ENTRY as COUPLED_ENTRY
from tests.cluster.test_coupled import ENV as COUPLED_ENV
from tests.cluster.test_coupled import restart as restart_coupled
from tests.cluster.test_dp import start
from tests.cluster.test_drain import rayfree
from tests.cluster.test_multinode import FAST, assert_nothing_left, needs_root
from tests.cluster.test_rejoin import restart
from tests.support.nodes import Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_through_drain"


@pytest.mark.timeout(400)
def test_scale_in_drains_the_highest_replica_and_scale_out_takes_it_back_while_replica_0_serves_on() -> None:
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **FAST)
        procs = start(nodes, 4, 2, 2, ENTRY)
        for k in (0, 2):
            procs[k].expect(r"^STEPPING:", 180)
        past = rayfree(sim, nodes, 1, "scale", "--dp", "3")
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
    assert past.returncode == 1 and "laid out for 2 DP replica(s)" in past.stderr, past
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
        nodes = Nodes(sim, **FAST)
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
    assert "drained by the operator" in r1["refused"], r1["refused"]
    assert "width 1 serving of 1 requested" in status.stdout and "replica 1: drained, epoch 0" in status.stdout
    assert wider.returncode == 0 and "DP width 1 -> 2: start node(s) [1] for replica(s) [1]" in wider.stdout
    assert r0["steps"] == r0["equal"] and [run[0] for run in r0["runs"]] == [[0, 1], [0], [0, 1]], r0
    assert r0["hooks"] == [[1, [0]], [2, [0, 1]]], r0["hooks"]  # (the engine's hook, at each width)
    assert all(c[:2] in ([1, [0]], [2, [0, 1]]) for c in r0["changes"]), r0["changes"]  # (run again)
    assert r0["states"] == {"0": ["serving", 0], "1": ["serving", 1]}, r0["states"]
    assert [c["wrong"] for rank in r0["checks"] for c in rank] == [[]] * 6, r0["checks"]
    assert back["epoch"] == 1 and back["steps"] == back["equal"] and [run[0] for run in back["runs"]] == [[0, 1]]
    assert codes == {0: 0, 1: 0}, codes
