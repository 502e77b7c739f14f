"""Node loss at the default heartbeat settings: a node killed, stopped (SIGSTOP) or cut off is known in about a
second, by the connection's own pings (libzmq's I/O thread), not by a Python thread's timing.

Two simulated nodes, one rank each, every rank busy in a call when the test takes node 1 (or node 0) away. The
bound asserted is the design's (RAYFREE_LINK_TIMEOUT_S 0.4 + its ping period + the 0.3 s reconnect window +
a 0.1 s poll: under 1 s) plus slack for a loaded 2-core machine; the figures are printed.
"""

from __future__ import annotations

import signal
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from tests.cluster.test_multinode import assert_nothing_left
from tests.support.nodes import READY_TIMEOUT_S, Nodes

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")

#: the defaults, not the faster heartbeats of the other multi-node tests
DEFAULTS = {
    "RAYFREE_HEARTBEAT_INTERVAL_S": "0.5",
    "RAYFREE_HEARTBEAT_TIMEOUT_S": "10",  # the beats' own timeout must not be what decides
    "RAYFREE_SHUTDOWN_GRACE_S": "2",
    "RAYFREE_SHUTDOWN_TERM_S": "2",
    "RAYFREE_READY_TIMEOUT_S": READY_TIMEOUT_S,
    "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
    "RAYFREE_PIPELINE_PARALLEL_SIZE": "1",
}
BOUND = 1.0
SLACK = 1.0


def _lose(sim: SimulatedCluster, k: int, how: str, lead) -> tuple[float, dict]:
    """Take node k away (`how`) while node 0's call is pending: when, and node 0's RESULT."""
    t_lost = time.monotonic()
    if how == "killed":
        sim.nodes[k].kill(signal.SIGKILL)
    elif how == "stopped":
        sim.nodes[k].kill(signal.SIGSTOP)
    else:
        sim.nodes[k].set_link(False)
    try:
        return t_lost, lead.result("RESULT", 60)
    finally:
        if how == "stopped":  # a stopped node never stops by itself
            sim.nodes[k].kill(signal.SIGKILL)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "stopped", "link-cut"])
def test_a_lost_follower_is_known_within_a_second(how: str) -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **DEFAULTS)
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:hang")
        follow = nodes.start(1)
        lead.result("PENDING", 150)
        t_lost, r = _lose(sim, 1, how, lead)
        assert lead.wait(60) == 1, lead.text()[-3000:]
        follow.wait(60)
        assert_nothing_left(sim, [lead, follow])
    took = r["t_fail"] - t_lost
    assert r["kind"] == "NodeLost+ExecutorFailed" and "node 1 (" in r["error"], r
    assert "connection dropped" in r["error"], r["error"]  # the link decided, not the beats' 10 s timeout
    assert took <= BOUND + SLACK, f"node 1 {how}: the pending call failed only after {took:.2f}s"
    print(f"\nfollower {how}: node 0's pending call failed after {took:.2f} s")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "stopped", "link-cut"])
def test_a_follower_knows_its_leader_is_gone_within_a_second_and_stops(how: str) -> None:
    """With the watch on (the default), the follower's beat link is held only to the beats' bound (10 s here):
    node 0 stopped or cut off is known by its ping-only link to node 0 (heartbeat_client.py), within a second."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **DEFAULTS)
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:serve")
        follow = nodes.start(1)
        lead.result("SERVING", 150)
        follow.expect("serving the leader", 30)
        t_kill = time.monotonic()
        try:
            if how == "killed":
                sim.nodes[0].kill(signal.SIGKILL)
            elif how == "stopped":
                sim.nodes[0].kill(signal.SIGSTOP)
            else:
                sim.nodes[0].set_link(False)
            follow.expect("leader lost", 30)
            took = time.monotonic() - t_kill
            assert follow.wait(30) == 1, follow.text()[-3000:]  # its workers stopped, it exits 1
            stopped = time.monotonic() - t_kill
        finally:
            if how == "stopped":  # a stopped node never stops by itself
                sim.nodes[0].kill(signal.SIGKILL)
        lead.wait(30)
        assert_nothing_left(sim, [follow] if how != "link-cut" else [lead, follow])  # (a killed node leaves its own)
    text = follow.text()
    assert "leader (node 0) is gone" in text and "the leader at tcp://" in text and "connection dropped" in text
    assert took <= BOUND + SLACK, f"the follower knew only after {took:.2f}s"
    print(f"\nleader {how}: the follower knew after {took:.2f} s and had stopped its workers after {stopped:.2f} s")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["stopped", "link-cut"])
def test_a_node_its_watcher_loses_is_known_within_a_second_though_its_link_to_node_0_waits_longer(how: str) -> None:
    """RAYFREE_WATCH_FANOUT=2, four nodes of one world: node 0 watches nodes 1 and 2, node 1 watches node 3
    (cluster/watch.py), whose own link to node 0 is held only to the beats' 10 s. Node 3 stopped or cut off: node 1
    tells node 0, and node 0's pending call fails in the same bound as for a follower it watches itself, naming
    the watcher."""
    env = {"RAYFREE_TENSOR_PARALLEL_SIZE": "4", "RAYFREE_NNODES": "4", "RAYFREE_WATCH_FANOUT": "2"}
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **{**DEFAULTS, **env})
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:hang")
        others = [nodes.start(k) for k in (1, 2, 3)]
        lead.result("PENDING", 150)
        t_lost, r = _lose(sim, 3, how, lead)
        assert lead.wait(60) == 1, lead.text()[-3000:]
        for p in others:
            p.wait(60)
        assert_nothing_left(sim, [lead, *others])
    took = r["t_fail"] - t_lost
    assert r["kind"] == "NodeLost+ExecutorFailed" and "node 3 (" in r["error"], r
    assert "its watcher (node 1)" in r["error"], r["error"]  # node 1's word decided, not node 0's own link
    assert took <= BOUND + SLACK, f"node 3 {how}: the pending call failed only after {took:.2f}s"
    print(f"\nwatched node {how}: node 0's pending call failed after {took:.2f} s")
