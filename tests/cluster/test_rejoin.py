"""A lost independent DP replica rejoins without a restart: its nodes, started again with the same command, are
admitted by node 0 in a new epoch, form the replica's world again and serve, while replica 0 never stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from rayfree.transport.secure.policy import write_secret
from tests.cluster.test_dp import start
from tests.cluster.test_multinode import LONG_BOUNDS, assert_nothing_left, needs_root
from tests.executor.test_observe import _status
from tests.support.nodes import ROOT, NodeProc, Nodes
from tests.support.paths import PYTHONPATH

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_through_rejoins"


def restart(nodes: Nodes, k: int, **env: str) -> NodeProc:
    """Node k of the 4-node DP=2 x TP=2 layout, as test_dp.start started it (replica 1: nodes 2 and 3)."""
    shape = {
        "RAYFREE_NNODES": "4",
        "RAYFREE_DATA_PARALLEL_SIZE": "2",
        "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
        "RAYFREE_PIPELINE_PARALLEL_SIZE": "1",
        **env,
    }
    return nodes.start(k, "leader" if k == 2 else "follower", **shape, **({"RAYFREE_ENTRY": ENTRY} if k == 2 else {}))


def three_replicas(sim: SimulatedCluster, lose: tuple[int, ...]) -> tuple[Nodes, dict[int, NodeProc]]:
    """DP=3 x TP=1 on three nodes, every replica stepping; then the nodes `lose`, killed one after the other,
    each known lost by node 0."""
    nodes = Nodes(sim, **LONG_BOUNDS)
    procs = start(nodes, 3, 3, 1, ENTRY)
    for k in range(3):
        procs[k].expect(r"^STEPPING:", 180)
    for k in lose:
        sim.nodes[k].kill()
        procs[0].expect(rf"DP replica {k} was lost", 60)
    return nodes, procs


def restart3(nodes: Nodes, k: int, **env: str) -> NodeProc:
    """Node k of the three-replica layout, started again."""
    shape = {"RAYFREE_NNODES": "3", "RAYFREE_DATA_PARALLEL_SIZE": "3", "RAYFREE_TENSOR_PARALLEL_SIZE": "1",
             "RAYFREE_PIPELINE_PARALLEL_SIZE": "1", "RAYFREE_ENTRY": ENTRY}  # fmt: skip
    return nodes.start(k, "leader", **{**shape, **env})


@pytest.mark.timeout(400)
def test_a_lost_replica_rejoins_twice_while_the_other_serves_on() -> None:
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **LONG_BOUNDS)
        procs = start(nodes, 4, 2, 2, ENTRY, RF_REJOINS="2")
        first = {k: procs[k].result("STEPPING", 180) for k in (0, 2)}
        everyone = list(procs.values())
        rejoined = []
        for epoch in (1, 2):
            t_kill = time.monotonic()
            sim.nodes[3].kill()
            assert procs[2].wait(60) != 0, procs[2].text()[-3000:]  # the lost replica's node leaves non-zero
            procs[2], procs[3] = restart(nodes, 2, RF_REJOINS="2"), restart(nodes, 3)
            everyone += [procs[2], procs[3]]
            back = procs[2].result("STEPPING", 180)
            r = procs[2].result("RESULT", 180)
            # (node 0 counts the replica serving once both nodes' beats say ready, which may come after its leader's
            # 20 steps: the next loss is of a serving replica, as replica 0's callbacks below expect)
            procs[0].expect(rf"DP replica 1 rejoined \(epoch {epoch}\) and serves again", 60)
            assert (back["epoch"], r["epoch"], r["outcome"], r["steps"], r["equal"]) == (
                epoch,
                epoch,
                "served",
                20,
                20,
            ), r
            rejoined.append(back["t"] - t_kill)
        r0 = procs[0].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    assert r0["outcome"] == "served" and r0["after"] == 20 and r0["equal"] == r0["steps"] + 20, r0
    assert [(k, state, e) for k, state, e, _t in r0["seen"]] == [
        (1, "lost", 0), (1, "serving", 1), (1, "lost", 1), (1, "serving", 2)
    ], r0["seen"]  # fmt: skip
    assert r0["states"] == {"0": ["serving", 0], "1": ["serving", 2]}, r0["states"]
    assert first[0]["pid"] and codes == {0: 0, 1: 0, 2: 0, 3: 0}, codes
    print(f"\nreplica 1 lost and rejoined twice; its new leader stepped {rejoined[0]:.1f} s / {rejoined[1]:.1f} s "
          f"after the kill; replica 0 served throughout")  # fmt: skip


@pytest.mark.timeout(400)
def test_a_replacement_with_another_secret_changes_nothing_and_the_lost_incarnation_is_refused(tmp_path) -> None:
    """Node 3 stopped (SIGSTOP) is lost, and replica 1 with it. A replacement holding another secret cannot even
    reach node 0's heartbeats (CURVE) and changes nothing: both sides say so in one line naming the secret, and it
    exits 2; one with the cluster's secret rejoins. A beat of the
    stopped incarnation (its old pid) is then refused, naming both epochs; resumed, the old process finds node 0
    deaf to it and leaves non-zero."""
    wrong, tail = str(tmp_path / "other.secret"), str(tmp_path / "tail-done")
    write_secret(wrong)
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **LONG_BOUNDS)  # (node 3 stopped is known past them: this is not about how fast)
        procs = start(nodes, 4, 2, 2, ENTRY, RF_TAIL_UNTIL_FILE=tail)
        for k in (0, 2):
            procs[k].expect(r"^STEPPING:", 180)
        old3 = procs[3]
        sim.nodes[3].kill(signal.SIGSTOP)
        assert procs[2].wait(60) != 0, procs[2].text()[-3000:]
        everyone = list(procs.values())
        procs[2] = restart(nodes, 2)
        t_stranger = time.monotonic()
        stranger = restart(nodes, 3, RAYFREE_SECRET_FILE=wrong)
        assert stranger.wait(60) == 2, stranger.text()[-3000:]  # (its CURVE handshake is refused: it says so)
        took = time.monotonic() - t_stranger
        refused = stranger.expect(r"rayfree node: node 0 at \S+ refused this node's key.*", 5).group(0)
        told = procs[0].expect(r"refused a connection whose CURVE handshake failed.*", 30).group(0)
        procs[3] = restart(nodes, 3)
        everyone += [procs[2], stranger, procs[3]]
        r2 = procs[2].result("RESULT", 180)
        beat = sim.nodes[3].popen(
            [sys.executable, "-m", "tests.support.stale_beat", sim.nodes[0].ip, nodes.env["RAYFREE_HEARTBEAT_PORT"],
             "3", str(old3.p.pid)], env={"PYTHONPATH": PYTHONPATH}, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert beat.wait(60) == 0
        stale = procs[0].expect(r"dropped a message from node 3's earlier incarnation.*", 30).group(0)
        for p in sim.nodes[3].procs:  # the stopped incarnation resumes (its workers too)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
        assert old3.wait(60) != 0, old3.text()[-3000:]
        with open(tail, "w"):
            pass
        r0 = procs[0].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    assert (r2["epoch"], r2["outcome"], r2["equal"]) == (1, "served", 20), r2
    assert "another secret than node 0" in refused and "--secret-file" in refused, refused
    assert "does not hold this cluster's secret" in told, told
    assert "still waiting for the leader" not in stranger.text(), stranger.text()[-3000:]
    print(f"\na replacement with another secret exited 2 after {took:.1f}s")
    assert "(epoch 0 or before), after its replacement" in stale and "joined in epoch 1" in stale, stale
    assert [(k, state, e) for k, state, e, _t in r0["seen"]] == [(1, "lost", 0), (1, "serving", 1)], r0["seen"]
    assert r0["equal"] == r0["steps"] + r0["after"] and codes == {0: 0, 1: 0, 2: 0, 3: 0}, (codes, r0)
    text = procs[0].text()
    assert f"(pid {stranger.p.pid})" not in text and f"(pid {procs[3].p.pid}) is admitted" in text, text[-4000:]
    assert text.count("is admitted: DP replica 1 rejoins in epoch 1") == 2, text[-4000:]


@pytest.mark.timeout(400)
def test_a_replacement_that_fails_mid_rejoin_restarts_the_rejoin_and_its_partner_is_told() -> None:
    """Replica 1 is lost and both its nodes are started again; node 3's replacement dies while it starts. Started
    once more, it is admitted in epoch 2, and node 2 (admitted in epoch 1, waiting in a rendezvous that can no
    longer complete) is told at once, leaves non-zero, and started again joins epoch 2; the replica serves."""
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **LONG_BOUNDS)
        procs = start(nodes, 4, 2, 2, ENTRY)
        for k in (0, 2):
            procs[k].expect(r"^STEPPING:", 180)
        sim.nodes[3].kill()
        assert procs[2].wait(60) != 0, procs[2].text()[-3000:]
        everyone = list(procs.values())
        procs[2], procs[3] = restart(nodes, 2), restart(nodes, 3)
        everyone += [procs[2], procs[3]]
        admitted: dict[int, int] = {}  # both, before node 3's dies: node 2 must be waiting in epoch 1
        said = r"node ([23])'s replacement \(pid (\d+)\) is admitted: DP replica 1 rejoins in epoch 1"
        while len(admitted) < 2:
            m = procs[0].expect(said, 60)
            admitted[int(m.group(1))] = int(m.group(2))
        assert admitted == {2: procs[2].p.pid, 3: procs[3].p.pid}, admitted
        sim.nodes[3].kill()  # the replacement dies while it starts
        procs[3] = restart(nodes, 3)
        everyone.append(procs[3])
        t_told = time.monotonic()
        assert procs[2].wait(60) != 0, procs[2].text()[-3000:]  # told: its epoch 1 will never form
        left_after = time.monotonic() - t_told
        told = procs[2].text()
        procs[2] = restart(nodes, 2)
        everyone.append(procs[2])
        back = procs[2].result("RESULT", 180)
        r0 = procs[0].result("RESULT", 120)
        codes = {k: p.wait(60) for k, p in procs.items()}
        assert_nothing_left(sim, everyone)
    assert "is given up (node 3's replacement failed) and starts again in epoch 2: start this node again" in told, (
        told[-4000:]
    )  # fmt: skip
    assert (back["epoch"], back["outcome"], back["equal"]) == (2, "served", 20), back
    assert [(k, state, e) for k, state, e, _t in r0["seen"]] == [(1, "lost", 0), (1, "serving", 2)], r0["seen"]
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, codes
    print(f"\nnode 2, admitted in the epoch given up, left {left_after:.1f} s after node 3's next replacement started")


@pytest.mark.timeout(400)
def test_a_replacement_knows_the_replicas_lost_before_it_started_and_one_of_another_shape_is_refused() -> None:
    """DP=3 on three nodes, independent: replicas 1 and 2 are lost. Node 2 started again with --tp 2, then as
    coupled, is refused each time by node 0 (one line on each side; the replacement exits 2), and replica 2 stays
    lost, shown so by `rayfree status`; started with the cluster's own shape it rejoins in epoch 1 (the refusals
    took no epoch), and from its Welcome it knows replica 1 is lost (its engine would not route there), as the
    nodes that heard it."""
    with SimulatedCluster(3) as sim:
        nodes, procs = three_replicas(sim, lose=(1, 2))
        everyone = list(procs.values())
        lines = []
        for env in ({"RAYFREE_TENSOR_PARALLEL_SIZE": "2"}, {"RAYFREE_REPLICA_COUPLING": "coupled"}):
            wrong = restart3(nodes, 2, **env)
            everyone.append(wrong)
            assert wrong.wait(120) == 2, wrong.text()[-3000:]
            lines.append(wrong.expect(r"rayfree node: node 2's replacement .*", 5).group(0))
            lines.append(procs[0].expect(rf"node 2's replacement \(pid {wrong.p.pid}\) was started as .*", 30).group(0))
        code, table, err = _status(sim, 0, nodes)  # (what an operator reads while replica 2 is lost)
        procs[2] = restart3(nodes, 2)
        everyone.append(procs[2])
        back = procs[2].result("RESULT", 180)
        r0 = procs[0].result("RESULT", 120)
        codes = {k: procs[k].wait(60) for k in (0, 2)}
        assert_nothing_left(sim, everyone)
    assert code == 0, err
    # the lost node's workers are not shown as alive, nor its replica's last call as still in flight
    assert "lost (last reported)" in table and "replica 2 (led by node 2)" not in table, table
    assert "replica 2: lost, epoch 0" in table, table
    assert "'tp=2 pp=1" in lines[0] and "but the cluster is 'tp=1 pp=1" in lines[0], lines
    assert "replicas=coupled" in lines[2] and "replicas=independent" in lines[2], lines
    assert all(line.endswith("refused") for line in lines[1::2]), lines
    assert procs[0].text().count("is admitted") == 1, procs[0].text()[-3000:]
    assert (back["epoch"], back["outcome"], back["equal"]) == (1, "served", 20), back
    assert back["states"] == {"0": ["serving", 0], "1": ["lost", 0], "2": ["serving", 1]}, back["states"]
    assert r0["states"] == {"0": ["serving", 0], "1": ["lost", 0], "2": ["serving", 1]}, r0["states"]
    assert codes == {0: 0, 2: 0}, codes


@pytest.mark.timeout(300)
def test_a_replacement_still_starting_when_node_0_stops_cleanly_exits_0_quietly() -> None:
    """DP=3 on three nodes: replica 2 is lost and node 2 started again, with a model that loads slowly. While its
    worker loads, the operator stops node 0 (SIGTERM): node 0's clean goodbye stops the replacement's start-up,
    and it exits 0 saying so, with no error (its replica was never lost again), as node 0 does. (Node 1's entry,
    mid-step, gets the stop as its call's error and returns 1: the test entry's own code.)"""
    with SimulatedCluster(3) as sim:
        nodes, procs = three_replicas(sim, lose=(2,))
        everyone = list(procs.values())
        procs[2] = restart3(nodes, 2, RAYFREE_WORKER="tests.support.sample_workers:EchoWorker",
                            RAYFREE_WORKER_KWARGS='{"distributed": true, "say_loading": true, "load_delay": 300}',
                            RAYFREE_READY_TIMEOUT_S="300")  # fmt: skip
        everyone.append(procs[2])
        procs[2].expect(r"LOADING:", 120)
        procs[0].p.send_signal(signal.SIGTERM)
        try:
            codes = {k: procs[k].wait(60) for k in range(3)}
        except AssertionError as e:  # (what node 0 said decides whether the node still starting was told)
            raise AssertionError(f"{e}\nnode 0:\n{procs[0].text()[-4000:]}") from None
        assert_nothing_left(sim, everyone)
    text = procs[2].text()
    assert (codes[0], codes[2]) == (0, 0), (codes, text[-4000:])
    assert "node 2: node 0 stopped the cluster while this node started" in text, text[-4000:]
    assert " ERROR " not in text and "Traceback" not in text, text[-4000:]
