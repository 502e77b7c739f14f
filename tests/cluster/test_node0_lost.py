"""Node 0 lost, with independent DP replicas that each run on one node, or, with the watch on
(RAYFREE_WATCH_FANOUT), on nodes that watch each other: node 0's replica is lost, and the others serve on with no
failed call (they need nothing of node 0 once formed). Without the watch, replicas spread over several nodes still
stop with node 0 (tests/cluster/test_dp.py): node 0 is their only watcher.

DP=3 x TP=1 on three simulated nodes, every replica's leader stepping (multinode_entry's
steps_while_a_replica_is_lost). Node 0 is SIGKILLed, SIGSTOPped past the link bound (resumed at the end), or cut
off from the network: either way each side serves what it has, and nobody admits anything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_dp import start, start_node
from tests.cluster.test_drain import rayfree
from tests.cluster.test_multinode import DETECT, HB_TIMEOUT, SLACK, assert_nothing_left, needs_root
from tests.executor.test_observe import _status
from tests.support.nodes import NodeProc, Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_while_a_replica_is_lost"
#: node 0 watches nodes 1 and 2 (each replica's first node), node 2 watches node 3 (cluster/watch.py)
WATCH = {"RAYFREE_WATCH_FANOUT": "8"}


def _lose_node_0(sim: SimulatedCluster, how: str) -> None:
    if how == "cut":
        sim.nodes[0].set_link(False)
    else:
        sim.nodes[0].kill(signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _node_0_back(sim: SimulatedCluster, how: str) -> None:
    if how == "stop":
        for p in sim.nodes[0].procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
    elif how == "cut":
        sim.nodes[0].set_link(True)


def _watched_node_0_killed(sim: SimulatedCluster, entry: str, **env: str) -> tuple[Nodes, dict[int, NodeProc], int]:
    """DP=2 x TP=2 on four nodes, the watch on, both leaders stepping; node 0 SIGKILLed once they do, until replica
    1's leader says it serves on and node 1 (replica 0's other node) has left: its exit code."""
    nodes = Nodes(sim, **DETECT)
    procs = start(nodes, 4, 2, 2, entry, **WATCH, **env)
    for k in (0, 2):
        procs[k].expect(r"^STEPPING:", 180)
    sim.nodes[0].kill()
    procs[2].expect(r"node 2: node 0 was lost \(", 60)
    return nodes, procs, procs[1].wait(60)


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
        _lose_node_0(sim, how)
        served = {k: procs[k].result("RESULT", 60) for k in (1, 2)}
        codes = {k: procs[k].wait(60) for k in (1, 2)}
        _node_0_back(sim, how)
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
def test_node_0_started_again_rejoins_as_replica_0s_leader_while_the_others_serve_on() -> None:
    """DP=3 x TP=1 on three nodes, every replica stepping: node 0 SIGKILLed, replicas 1 and 2 serve on without it.
    Node 0 started again with the same command resumes the cluster from their epochs: its replica rejoins in
    epoch 1 at a store of its own and takes 20 checked steps, nodes 1 and 2 follow it again and hear replica 0
    serve again (callback and query, epoch 1), with no failed call through it all; then the cluster stops as
    any does (node 0 waits for every replica's entry, its goodbye ends the others), every node exiting 0."""
    entry = "tests.support.multinode_entry:steps_through_node_0_restart"
    with SimulatedCluster(3) as sim:
        nodes = Nodes(sim, **DETECT)
        procs = start(nodes, 3, 3, 1, entry)
        for k in range(3):
            procs[k].expect(r"^STEPPING:", 180)
        sim.nodes[0].kill()
        for k in (1, 2):
            procs[k].expect(r"node \d: node 0 was lost \(", 60)
        everyone = list(procs.values())
        t_again = time.monotonic()
        again = start_node(nodes, 0, 3, 3, 1, entry)
        everyone.append(again)
        served = {k: procs[k].result("RESULT", 240) for k in (1, 2)}
        r0 = again.result("RESULT", 60)
        codes = {k: procs[k].wait(60) for k in (1, 2)}
        codes[0] = again.wait(60)
        texts = {0: again.text(), 1: procs[1].text(), 2: procs[2].text()}
        assert_nothing_left(sim, everyone)
    for k in (0, 1, 2):
        assert "Traceback" not in texts[k], texts[k][-4000:]
    assert r0["outcome"] == "served" and r0["epoch"] == 1 and r0["after"] == r0["equal"] == 20, r0
    assert "it resumes the cluster from their epochs; its DP replica(s) [0] rejoin in epoch(s) [1]" in texts[0]
    for k, r in served.items():
        why = f"node {k}: {r}\n{texts[k][-4000:]}"
        assert r["outcome"] == "served" and r["after"] == 20 and r["equal"] == r["steps"] + 20, why  # none failed
        assert [(j, state, e) for j, state, e, _t in r["seen"]] == [(0, "lost", 0), (0, "serving", 1)], why
        assert r["states"] == {"0": ["serving", 1], "1": ["serving", 0], "2": ["serving", 0]}, why
        assert f"node {k}: node 0 is back and leads the cluster again: DP replica(s) [0] serve again" in texts[k], why
        assert f"node 0: node {k} (" in texts[0] and "follows it again" in texts[0], texts[0][-4000:]
        back = r["seen"][1][3] - t_again
        print(f"\nnode 0 started again: node {k} heard replica 0 serve again {back:.1f}s after ({r['steps']} steps "
              f"before, none failed)")  # fmt: skip
    assert codes == {0: 0, 1: 0, 2: 0}, codes


@pytest.mark.timeout(400)
def test_node_0_started_again_resumes_a_drained_replica_and_the_requested_width(tmp_path) -> None:
    """DP=3 x TP=1 on three nodes: `rayfree scale --dp 2` drains replica 2 (node 2 exits), then node 0 is
    SIGKILLed and replica 1 serves on. Node 0 started again resumes what node 1 knew: replica 2 drained and the
    requested width 2. It does not wait for node 2 (nor calls it lost), and `rayfree status` says so."""
    entry, hold = "tests.support.multinode_entry:steps_through_node_0_restart", str(tmp_path / "hold")
    with SimulatedCluster(3) as sim:
        nodes = Nodes(sim, **DETECT)
        procs = start(nodes, 3, 3, 1, entry, RF_HOLD=hold)
        for k in range(3):
            procs[k].expect(r"^STEPPING:", 180)
        narrower = rayfree(sim, nodes, 1, "scale", "--dp", "2")
        procs[2].wait(120)  # (drained: its calls are refused, and it stops)
        procs[1].expect(r"DP replica 2 was drained", 60)
        sim.nodes[0].kill()
        procs[1].expect(r"node 1: node 0 was lost \(", 60)
        again = start_node(nodes, 0, 3, 3, 1, entry, RF_HOLD=hold)
        everyone = [*procs.values(), again]
        r0 = again.result("RESULT", 240)
        served = procs[1].result("RESULT", 60)
        status = rayfree(sim, nodes, 1, "status")  # (both entries hold until the file is made)
        open(hold, "w").close()
        codes = {0: again.wait(60), 1: procs[1].wait(60)}
        texts = {0: again.text(), 1: procs[1].text()}
        assert_nothing_left(sim, everyone)
    assert narrower.returncode == 0 and "DP width 3 -> 2: replicas [2] drain" in narrower.stdout, narrower
    assert "Traceback" not in texts[0] + texts[1], texts[0][-4000:] + texts[1][-4000:]
    assert ("its DP replica(s) [0] rejoin in epoch(s) [1]; DP replica 2 drained; the requested DP width is 2" in
            texts[0]), texts[0][-4000:]  # fmt: skip
    assert "node 0: node 2 (ranks [2]) is not waited for" in texts[0], texts[0][-4000:]
    assert "never sent a heartbeat" not in texts[0], texts[0][-4000:]
    assert r0["outcome"] == "served" and r0["epoch"] == 1 and r0["after"] == r0["equal"] == 20, r0
    assert r0["states"] == {"0": ["serving", 1], "1": ["serving", 0], "2": ["drained", 0]}, r0
    assert served["outcome"] == "served" and served["equal"] == served["steps"] + 20, served  # none failed
    assert [s[:2] for s in served["seen"]] == [[2, "draining"], [2, "drained"], [0, "lost"], [0, "serving"]], served
    assert "width 2 serving of 2 requested" in status.stdout and "replica 2: drained" in status.stdout, status
    assert codes == {0: 0, 1: 0}, codes


@pytest.mark.timeout(300)
def test_node_0_and_another_node_lost_together_both_rejoin_while_the_third_serves_on() -> None:
    """DP=3 x TP=1 on three nodes: nodes 0 and 2 SIGKILLed together, node 1 serves on without node 0 (it watches
    only node 0, so it knows nothing of node 2). Both started again with their commands, node 2 first: node 0
    resumes the cluster from node 1's epochs, finds node 2 a process started beside it (its first beat is not
    `alone`), counts its earlier process lost and admits it as its replacement; replicas 0 and 2 rejoin in epoch 1
    and take 20 checked steps each, node 1 hears both serve again in epoch 1 and fails no call; every node exits 0
    at the cluster's clean stop."""
    entry = "tests.support.multinode_entry:steps_through_node_0_restart"
    both = {"RF_BACK": "0,2"}
    with SimulatedCluster(3) as sim:
        nodes = Nodes(sim, **DETECT)
        procs = start(nodes, 3, 3, 1, entry, **both)
        for k in range(3):
            procs[k].expect(r"^STEPPING:", 180)
        sim.nodes[0].kill()
        sim.nodes[2].kill()
        procs[1].expect(r"node 1: node 0 was lost \(", 60)
        again = {k: start_node(nodes, k, 3, 3, 1, entry, **both) for k in (2, 0)}
        everyone = [*procs.values(), *again.values()]
        served = procs[1].result("RESULT", 240)
        results = {k: again[k].result("RESULT", 60) for k in (0, 2)}
        codes = {1: procs[1].wait(60), **{k: again[k].wait(60) for k in (0, 2)}}
        texts = {0: again[0].text(), 1: procs[1].text(), 2: again[2].text()}
        assert_nothing_left(sim, everyone)
    for k in (0, 1, 2):
        assert "Traceback" not in texts[k], texts[k][-4000:]
    for k, r in results.items():
        assert r["outcome"] == "served" and r["epoch"] == 1 and r["after"] == r["equal"] == 20, (k, r)
    assert "node 2's replacement" in texts[0] and "DP replica 2 rejoins in epoch 1" in texts[0], texts[0][-4000:]
    why = f"{served}\n{texts[1][-4000:]}"
    assert served["outcome"] == "served" and served["equal"] == served["steps"] + 20, why  # no call failed
    assert served["states"] == {"0": ["serving", 1], "1": ["serving", 0], "2": ["serving", 1]}, why
    assert [(j, st, e) for j, st, e, _t in served["seen"] if j == 0] == [(0, "lost", 0), (0, "serving", 1)], why
    assert codes == {0: 0, 1: 0, 2: 0}, codes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["kill", "stop", "cut"])
def test_with_the_watch_node_0_lost_costs_only_its_replica_when_replicas_span_nodes(how: str) -> None:
    """DP=2 x TP=2 on four nodes, the watch on: node 0 SIGKILLed, SIGSTOPped past the link bound, or cut off.
    Replica 1 (nodes 2 and 3) hears replica 0 lost, naming node 0, within the bound, takes 20 more correct steps
    with no failed call, and ends cleanly: node 2 exits 0, and node 3 with it on node 2's goodbye (its watcher's:
    nobody else is left to say it). Node 1, replica 0's follower, leaves non-zero: its leader is lost."""
    with SimulatedCluster(4) as sim:
        procs = start(Nodes(sim, **DETECT), 4, 2, 2, ENTRY, **WATCH)
        for k in (0, 2):
            procs[k].expect(r"^STEPPING:", 180)
        t_lost = time.monotonic()
        _lose_node_0(sim, how)
        served = procs[2].result("RESULT", 60)
        codes = {k: procs[k].wait(60) for k in (1, 2, 3)}
        _node_0_back(sim, how)
        codes[0] = procs[0].wait(60)
        texts = {k: p.text() for k, p in procs.items()}
        assert_nothing_left(sim, procs.values())
    why = f"{served}\n{texts[2][-4000:]}\n--- node 3\n{texts[3][-3000:]}"
    assert served["outcome"] == "served" and served["after"] == served["equal"] == 20, why  # no call failed
    assert [(j, state) for j, state, *_ in served["seen"]] == [(0, "lost")] and "node 0" in served["seen"][0][2], why
    assert served["states"]["0"][0] == "lost" and served["states"]["1"][0] == "serving", why
    heard = served["seen"][0][3] - t_lost
    assert heard < HB_TIMEOUT + SLACK, f"node 2 heard of replica 0's loss after {heard:.2f}s"
    assert "node 2: node 0 was lost (" in texts[2] and "this node's replica(s) [1] serve on" in texts[2], why
    assert "node 3: node 2 stopped its replica (node 0 lost" in texts[3], why
    for k in (2, 3):
        assert "leader lost" not in texts[k] and "Traceback" not in texts[k], texts[k][-4000:]
    assert codes[2] == codes[3] == 0 and codes[1] != 0, (codes, texts[1][-3000:])
    print(f"\nthe watch, node 0 {how}: node 2 knew replica 0 lost after {heard:.2f}s and served on; codes {codes}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("second", [3, 2], ids=["then-its-follower", "then-its-leader"])
def test_with_the_watch_a_node_of_replica_1_lost_after_node_0_is_decided_by_its_watch(second: int) -> None:
    """DP=2 x TP=2 on four nodes, the watch on, node 0 SIGKILLed; once replica 1 serves on without it, one of its
    nodes is SIGKILLed too. Nobody is left to decide that loss but replica 1's own nodes: node 3 killed, node 2
    (its watcher) fails its call with ReplicaLost naming node 3 within the link's bound; node 2 killed, node 3
    finds its watcher lost. Both leave non-zero, nothing is left behind."""
    entry = "tests.support.multinode_entry:steps_until_this_replica_fails"
    with SimulatedCluster(4) as sim:
        procs = start(Nodes(sim, **DETECT), 4, 2, 2, entry, **WATCH)
        for k in (0, 2):
            procs[k].expect(r"^STEPPING:", 180)
        sim.nodes[0].kill()
        for k in (2, 3):
            procs[k].expect(rf"node {k}: node 0 was lost \(", 60)
        t_lost = time.monotonic()
        sim.nodes[second].kill()
        r = procs[2].result("RESULT", 60) if second == 3 else None
        survivor = 5 - second
        code = procs[survivor].wait(60)
        text = procs[survivor].text()
        assert_nothing_left(sim, procs.values())
    assert code != 0 and "Traceback" not in text, (code, text[-4000:])
    if r is not None:
        took = r["t_fail"] - t_lost
        assert r["outcome"] == "failed" and r["kind"] == "ReplicaLost" and r["lost_dp"] == 1, (r, text[-4000:])
        assert r["lost_node"] == 3 and "node 2's watch decided" in r["error"], r
        assert took < HB_TIMEOUT + SLACK, f"node 3 lost after node 0: node 2's call failed after {took:.2f}s"
        print(f"\nnode 0 lost, then node 3: node 2's call failed with ReplicaLost after {took:.2f}s")
    else:
        assert "node 3: its watcher, node 2, is lost" in text, text[-4000:]
        print("\nnode 0 lost, then node 2: node 3 found its watcher lost and left")


@pytest.mark.timeout(400)
def test_with_the_watch_node_0_started_again_with_its_replicas_other_node_resumes_the_cluster() -> None:
    """DP=2 x TP=2 on four nodes, the watch on, every replica stepping: node 0 SIGKILLed, replica 1 (nodes 2 and 3)
    serves on, node 1 (replica 0's other node) leaves with node 0. Nodes 1 and 0 started again with their commands:
    node 0 resumes the cluster from replica 1's epochs, node 1 is welcomed as its replica's node (not counted as a
    lost node's replacement), replica 0 rejoins in epoch 1 over both and takes 20 checked steps; nodes 2 and 3 follow
    node 0 again, node 2 hears replica 0 serve again (epoch 1) with no failed call, and every node exits 0."""
    entry = "tests.support.multinode_entry:steps_through_node_0_restart"
    with SimulatedCluster(4) as sim:
        nodes, procs, lost_code = _watched_node_0_killed(sim, entry)
        alone = _status(sim, 3, nodes, "--json", "--ask", sim.nodes[2].ip)  # (replica 1's leader answers for itself)
        table = _status(sim, 3, nodes, "--ask", sim.nodes[2].ip)
        unanswered = _status(sim, 3, nodes, "--timeout", "2")  # (node 0 is lost)
        again = {k: start_node(nodes, k, 4, 2, 2, entry, **WATCH) for k in (1, 0)}
        everyone = [*procs.values(), *again.values()]
        served = procs[2].result("RESULT", 240)
        r0 = again[0].result("RESULT", 60)
        codes = {k: procs[k].wait(60) for k in (2, 3)} | {k: again[k].wait(60) for k in (0, 1)}
        texts = {0: again[0].text(), 1: again[1].text(), 2: procs[2].text(), 3: procs[3].text()}
        assert_nothing_left(sim, everyone)
    assert lost_code != 0, procs[1].text()[-3000:]
    for k in range(4):
        assert "Traceback" not in texts[k], texts[k][-4000:]
    assert r0["outcome"] == "served" and r0["epoch"] == 1 and r0["after"] == r0["equal"] == 20, r0
    assert "it resumes the cluster from their epochs; its DP replica(s) [0] rejoin in epoch(s) [1]" in texts[0]
    assert re.search(r"follower node 1 \(\S+, ranks \[1\]\) is beating", texts[0]), texts[0][-4000:]
    assert "node 1's replacement" not in texts[0] and "ranks [1]) lost" not in texts[0], texts[0][-4000:]
    assert "waiting for node 2 " not in texts[0] and "waiting for node 3 " not in texts[0], texts[0][-4000:]
    why = f"{served}\n{texts[2][-4000:]}"
    assert served["outcome"] == "served" and served["after"] == 20 and served["equal"] == served["steps"] + 20, why
    assert [(j, st, e) for j, st, e, _t in served["seen"]] == [(0, "lost", 0), (0, "serving", 1)], why
    assert served["states"] == {"0": ["serving", 1], "1": ["serving", 0]}, why
    for k in (2, 3):
        assert f"node 0: node {k} (" in texts[0], texts[0][-4000:]
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, codes
    assert alone[0] == 0, alone
    st = json.loads(alone[1])
    assert st["answered_by"] == 2 and st["node_0_lost"] and [n["node"] for n in st["nodes"]] == [2], st
    assert {r["replica"]: r["state"] for r in st["replicas"]} == {0: "lost", 1: "serving"}, st["replicas"]
    assert [r["replica"] for r in st["nodes"][0]["leads"]] == [1], st["nodes"][0]
    assert table[0] == 0 and "node 2 answers for itself" in table[1] and "replica 0: lost, epoch 0" in table[1], table
    assert re.search(rf"^2 +{re.escape(sim.nodes[2].ip)} +ok +self ", table[1], re.M), table[1]
    print(f"\n$ rayfree status --ask {sim.nodes[2].ip}   (node 0 lost)\n{table[1]}")
    assert unanswered[0] == 1 and "rayfree status --ask ITS_ADDRESS" in unanswered[2], unanswered
    assert "node 2: no longer answers `rayfree status --ask`: node 0 is back" in texts[2], texts[2][-3000:]


@pytest.mark.timeout(300)
def test_with_the_watch_node_0_started_again_without_its_replicas_other_node_leaves_and_the_others_serve_on() -> None:
    """DP=2 x TP=2 on four nodes, the watch on, node 0 SIGKILLed: replica 1 serves on, node 1 (replica 0's other
    node) leaves with node 0. Node 0 started again alone resumes the cluster, but its replica cannot form without
    node 1: past its join bound it leaves non-zero naming what is missing, and replica 1 serves on through it;
    stopped with SIGTERM, node 2 ends replica 1, and node 3 leaves with it (its watcher's goodbye). (Its entry
    says how its call ended: beside a second suite that took longer than the default 0.5 s grace in CI.)"""
    entry = "tests.support.multinode_entry:steps_until_this_replica_fails"
    with SimulatedCluster(4) as sim:
        nodes, procs, lost_code = _watched_node_0_killed(sim, entry, RAYFREE_ENTRY_GRACE_S="20")
        assert lost_code != 0, procs[1].text()[-3000:]
        again = start_node(nodes, 0, 4, 2, 2, entry, **WATCH, RAYFREE_JOIN_TIMEOUT_S="20")
        code = again.wait(180)
        assert procs[2].p.poll() is None and procs[3].p.poll() is None, procs[2].text()[-3000:]  # (served on)
        sim.nodes[2].kill(signal.SIGTERM)
        r = procs[2].result("RESULT", 60)
        codes = {k: procs[k].wait(60) for k in (2, 3)}
        texts = {0: again.text(), 2: procs[2].text(), 3: procs[3].text()}
        assert_nothing_left(sim, [*procs.values(), again])
    assert code != 0 and "Traceback" not in texts[0], texts[0][-4000:]
    assert "it resumes the cluster from their epochs" in texts[0], texts[0][-4000:]
    assert "JoinError: rank 0: rank(s) [1] of 2 never joined the world" in texts[0], texts[0][-4000:]
    assert r["steps"] > 0 and r["outcome"] in ("served", "failed"), r
    assert "Traceback" not in texts[2] + texts[3], (texts[2][-3000:], texts[3][-3000:])
    print(f"\nnode 0 started again without node 1: exit {code}; replica 1 stopped by SIGTERM: codes {codes}")
