"""Node 0 lost, with independent DP replicas that each run on one node: node 0's replica is lost, and the others
serve on with no failed call (they need nothing of node 0 once formed). Replicas spread over several nodes still
stop with node 0 (tests/cluster/test_dp.py): node 0 is their heartbeats' hub.

DP=3 x TP=1 on three simulated nodes, every replica's leader stepping (multinode_entry's
steps_while_a_replica_is_lost). Node 0 is SIGKILLed, SIGSTOPped past the link bound (resumed at the end), or cut
off from the network: either way each side serves what it has, and nobody admits anything.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_dp import start, start_node
from tests.cluster.test_multinode import DETECT, FAST, HB_TIMEOUT, SLACK, assert_nothing_left, needs_root
from tests.support.nodes import Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_while_a_replica_is_lost"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["kill", "stop", "cut"])
def test_node_0_lost_costs_only_its_replica_when_each_replica_runs_on_one_node(how: str) -> None:
    """Replicas 1 and 2 hear replica 0 lost (callback and query), naming node 0, take 20 more correct steps with
    no failed call and exit 0, saying on one line what they serve on without. Node 0 stopped or cut off finds,
    replicas 1 and 2 lost once it runs or is reachable again (one then the other, maybe: its entry takes its 20 steps
    at the first): it served its own replica through it."""
    with SimulatedCluster(3) as sim:
        procs = start(Nodes(sim, **DETECT), 3, 3, 1, ENTRY)
        for k in range(3):
            procs[k].expect(r"^STEPPING:", 180)
        t_lost = time.monotonic()
        if how == "cut":
            sim.nodes[0].set_link(False)
        else:
            sim.nodes[0].kill(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        served = {k: procs[k].result("RESULT", 60) for k in (1, 2)}
        codes = {k: procs[k].wait(60) for k in (1, 2)}
        if how == "stop":
            for p in sim.nodes[0].procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGCONT)
        elif how == "cut":
            sim.nodes[0].set_link(True)
        r0 = procs[0].result("RESULT", 60) if how != "kill" else None
        codes[0] = procs[0].wait(60)
        texts = {k: p.text() for k, p in procs.items()}
        assert_nothing_left(sim, procs.values())
    for k, r in served.items():
        why = f"node {k}: {r}\n{texts[k][-4000:]}"
        assert r["outcome"] == "served" and r["after"] == r["equal"] == 20, why  # no call failed
        assert [(j, state) for j, state, *_ in r["seen"]] == [(0, "lost")] and "node 0" in r["seen"][0][2], why
        assert r["states"]["0"][0] == "lost" and r["states"][str(k)][0] == "serving", why
        heard = r["seen"][0][3] - t_lost
        assert heard < HB_TIMEOUT + SLACK, f"node {k} heard of replica 0's loss after {heard:.2f}s"
        assert f"node {k}: node 0 was lost (" in texts[k] and f"this node's replica(s) [{k}] serve on" in texts[k], (
            texts[k][-4000:]
        )  # fmt: skip
        assert "leader lost" not in texts[k] and "Traceback" not in texts[k], texts[k][-4000:]
        print(f"\nnode 0 {how}: node {k} knew replica 0 lost after {heard:.2f}s and served on")
    assert codes[1] == codes[2] == 0, codes
    if r0 is not None:  # (each side served its own: node 0 found the others lost, and admitted nobody)
        assert r0["outcome"] == "served" and r0["after"] == r0["equal"] == 20, r0
        assert r0["states"]["0"][0] == "serving" and "lost" in {r0["states"][k][0] for k in "12"}, r0["states"]
        assert all(f"DP replica {k} was lost" in texts[0] for k in (1, 2)), texts[0][-4000:]  # (both, in the end)
        assert codes[0] == 0 and "is admitted" not in texts[0], (codes, texts[0][-4000:])


@pytest.mark.timeout(300)
def test_node_0_started_again_while_the_others_serve_without_it_is_told_so_at_once() -> None:
    """DP=2 x TP=1 on two nodes: node 0 SIGKILLed, node 1 serves on alone. Node 0 started again with the same
    command does not wait its join timeout for a node that will not join: node 1's beats say it serves without
    node 0, and node 0 says so in one line naming what to do, and exits 2; node 1 serves on, untouched."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        serve = {"RF_SERVE_S": "240"}
        procs = start(nodes, 2, 2, 1, "tests.support.multinode_entry:serve", **serve)
        for k in (0, 1):
            procs[k].expect(r"^SERVING:", 180)
        sim.nodes[0].kill()
        procs[1].expect(r"node 1: node 0 was lost \(", 60)
        everyone = list(procs.values())
        t_again = time.monotonic()
        again = start_node(nodes, 0, 2, 2, 1, "tests.support.multinode_entry:serve", **serve)
        everyone.append(again)
        code = again.wait(120)
        took = time.monotonic() - t_again
        alive = procs[1].p.poll() is None
        procs[1].p.send_signal(signal.SIGTERM)
        procs[1].wait(60)
        text = again.text()
        assert_nothing_left(sim, everyone)
    assert code == 2, text[-4000:]
    assert "node 1 serves DP replica(s) [1] without node 0 since it lost node 0's earlier process" in text, text[-4000:]
    assert "stop every node, then start the cluster again" in text and "Traceback" not in text, text[-4000:]
    assert alive, procs[1].text()[-4000:]
    assert "Traceback" not in procs[1].text(), procs[1].text()[-4000:]
    print(f"\nnode 0 started again while node 1 served without it: told and out after {took:.1f}s")
