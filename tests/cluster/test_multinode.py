"""Two simulated nodes x two ranks, the full executor, started with docker-compose.yml's invocations.

Each node has its own network namespace, IP and /dev/shm (CI runs as root).
The leader's entry points are in tests/support/multinode_entry.py. Heartbeats here:
every 0.2 s, lost after 2 s.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from tests.support.nodes import READY_TIMEOUT_S, Nodes, shm_files, wait_group_empty

HB_TIMEOUT = 5.0
#: Detection may take one heartbeat timeout, plus a poll period and scheduling on a loaded 2-core machine.
SLACK = 2.0
#: These tests are about what a loss does, not how fast it is known (test_detection.py and the soak keep the
#: default link bound, 0.4 s): two of them side by side start a dozen processes that import torch on two
#: cores, and a node's I/O thread, or the kernel's packet work, can wait longer than 0.4 s there; a heartbeat
#: thread there waited 2 s for a CPU. (The entries, tests/support/multinode_entry.py, import torch at the top:
#: imported inside them, it held a leader's heartbeats up for 1.2-3.5 s under load.)
FAST = {
    "RAYFREE_HEARTBEAT_INTERVAL_S": "0.2",
    "RAYFREE_HEARTBEAT_TIMEOUT_S": str(HB_TIMEOUT),
    "RAYFREE_LINK_TIMEOUT_S": "2.0",
    "RAYFREE_SHUTDOWN_GRACE_S": "2",
    "RAYFREE_SHUTDOWN_TERM_S": "2",
    "RAYFREE_READY_TIMEOUT_S": READY_TIMEOUT_S,
}

#: For the tests that are not about how fast a loss is known: beside another suite on two cores a live node's
#: heartbeat thread waited 6.2 s for a CPU, past FAST's link bound and heartbeat timeout, and a live replica was
#: lost. Longer bounds than that here. A killed node's connections drop at once whatever the bound; a stopped
#: one is known past these (the tests that time detection, test_detection.py and test_dp.py, keep FAST's).
LONG_BOUNDS = {**FAST, "RAYFREE_HEARTBEAT_TIMEOUT_S": "15", "RAYFREE_LINK_TIMEOUT_S": "12.0"}

#: For the tests that time a loss by its link (SIGSTOP, a cut link, SIGKILL): FAST's 2 s link bound decides, and
#: the heartbeats' silence bound is past a start-up starved beside another suite (a node still importing torch
#: there was lost for "no heartbeat for 5.0s"). The tests' bound on detection, HB_TIMEOUT + SLACK, is unchanged.
DETECT = {**FAST, "RAYFREE_HEARTBEAT_TIMEOUT_S": "15"}

needs_root = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")


def assert_nothing_left(sim: SimulatedCluster, nodes) -> None:
    for n in nodes:
        left = wait_group_empty(n.p.pid, 10)
        assert not left, f"node {n.node.index}: processes left: {left}\n{n.text()[-3000:]}"
        left = shm_files(n.node)
        assert not left, f"node {n.node.index}: segments left in its /dev/shm: {left}\n{n.text()[-3000:]}"


def run_to_the_end(sim: SimulatedCluster, entry: str, **env: str) -> dict:
    """Node 0 runs multinode_entry's `entry` with node 1 serving; both exit 0 and leave nothing; its RESULT."""
    nodes = Nodes(sim, **FAST, **env)
    lead = nodes.start(0, RAYFREE_ENTRY=f"tests.support.multinode_entry:{entry}")
    follow = nodes.start(1)
    r = lead.result("RESULT", 180)
    assert lead.wait(60) == 0, lead.text()[-3000:]
    assert follow.wait(30) == 0, follow.text()[-3000:]
    assert_nothing_left(sim, [lead, follow])
    return r


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "use_netns,broadcast",
    [(None, "relay"), (None, "flat"), (False, "relay")],
    ids=["namespaces", "namespaces-flat", "loopback-fallback"],
)
def test_two_nodes_full_executor_equals_the_single_process_model(use_netns, broadcast) -> None:
    """One body over both broadcast paths: each follower rank subscribed to node 0 (flat), or node 1's relay
    writing its ring (relay)."""
    with SimulatedCluster(2, use_netns=use_netns) as sim:
        r = run_to_the_end(sim, "check", RAYFREE_BROADCAST=broadcast)
    assert r["equal"] == r["steps"] == 20
    info = {x["rank"]: x for x in r["info"]}
    assert sorted(info) == [0, 1, 2, 3]
    for rank, x in info.items():
        node = rank // 2
        assert x["node"] == node and x["ip"] == sim.nodes[node].ip, x
        assert x["broadcast"] == ("shm" if node == 0 else "tcp" if broadcast == "flat" else "relay"), x
        if sim.mode == "netns":  # loopback fallback: every rank but the writer's node is remote anyway
            assert x["replies"] == ("shm" if node == 0 else "tcp"), x
    assert r["unique"]["rank"] == 3 and r["unique"]["ip"] == sim.nodes[1].ip
    assert "worker rank 2 raised KeyError" in r["error"] and "raised on purpose by rank 2" in r["error"]
    assert "Worker traceback (rank 2)" in r["error"]
    assert r["after"] == [None] * 4
    print(
        f"\ntiny RPC round trip p50 ({sim.mode}): local rank {r['rtt_local_us']:.0f} us, remote rank "
        f"{r['rtt_remote_us']:.0f} us"
    )


@needs_root
@pytest.mark.timeout(240)
def test_shared_arguments_reach_every_node_s_ranks_as_views_of_their_node_s_ring() -> None:
    """`shared_arguments` on two nodes: node 0's ranks read the executor's ring, node 1's the ring its relay
    writes; a 32 MiB argument is a view of it on every rank, and each call's views die with the call."""
    with SimulatedCluster(2) as sim:
        r = run_to_the_end(sim, "shared_arguments", RAYFREE_SHARED_ARGUMENTS="1")
    assert r["sums_ok"] and [(h["rank"], h["shared"]) for h in r["homes"]] == [(k, True) for k in range(4)], r


@needs_root
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "link-cut", "killed-mid-step"])
def test_a_lost_follower_fails_the_pending_call_naming_the_node(how: str) -> None:
    """killed-mid-step: the leader's ranks are in gloo send/recv with the lost node's, and fail first with a
    connection error; the cause reported must still be the lost node."""
    entry = "step_until_lost" if how == "killed-mid-step" else "hang"
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        lead = nodes.start(0, RAYFREE_ENTRY=f"tests.support.multinode_entry:{entry}")
        follow = nodes.start(1)
        lead.result("PENDING", 150)
        t_lost = time.monotonic()
        if how.startswith("killed"):
            sim.nodes[1].kill(signal.SIGKILL)
        else:
            sim.nodes[1].set_link(False)
        r = lead.result("RESULT", 60)
        assert lead.wait(60) == 1, lead.text()[-3000:]  # the entry returned 0, but the cluster failed
        if how == "link-cut":  # the follower, cut off, loses its leader too and stops on its own
            assert follow.wait(HB_TIMEOUT + 15) == 1, follow.text()[-3000:]
            assert "leader (node 0) is gone" in follow.text()
            t_follower = time.monotonic() - t_lost
        assert_nothing_left(sim, [lead, follow])
    took = r["t_fail"] - t_lost
    assert r["kind"] == "NodeLost+ExecutorFailed", r  # `except NodeLost` caught it, and it is an ExecutorFailed
    assert r["later_kind"] == "NodeLost", r
    assert "node 1 (" in r["error"] and "ranks [2, 3]" in r["error"], r["error"]
    assert took <= HB_TIMEOUT + SLACK, f"the pending call failed {took:.2f}s after the node was {how}"
    assert "node 1" in r["later"] and r["later_s"] < 1.0, r
    assert r["callbacks"] == 1
    print(
        f"\nfollower {how}: the leader's pending call failed after {took:.2f} s (heartbeat timeout "
        f"{HB_TIMEOUT} s)" + (f"; the follower exited after {t_follower:.2f} s" if how == "link-cut" else "")
    )


@pytest.mark.timeout(180)
def test_sigterm_to_node_0_mid_run_stops_every_node_cleanly() -> None:
    """What `docker compose stop` or Ctrl-C does: an operator's stop, even mid-step, is a clean stop for the
    cluster; the follower is told so and exits 0 instead of reporting its leader failed."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST, RAYFREE_DEMO_STEPS="1000000")
        lead = nodes.start(0)
        follow = nodes.start(1)
        lead.expect(r"step 50/", 120)
        lead.p.send_signal(signal.SIGTERM)
        assert lead.wait(60) == 0, lead.text()[-3000:]
        assert follow.wait(30) == 0, follow.text()[-3000:]
        assert_nothing_left(sim, [lead, follow])
    assert "stopped on request (SIGTERM on node 0)" in follow.text(), follow.text()[-2000:]


@needs_root
@pytest.mark.timeout(240)
def test_an_outsider_without_the_secret_gets_nothing_and_changes_nothing() -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:outsiders")
        follow = nodes.start(1)
        r = lead.result("RESULT", 180)
        assert lead.wait(60) == 0, lead.text()[-3000:]
        assert follow.wait(30) == 0, follow.text()[-3000:]  # a delivered forged goodbye would have failed it
        assert_nothing_left(sim, [lead, follow])
    rep = r["report"]
    assert len(r["endpoints"]["pub"]) == 3 and len(r["endpoints"]["router"]) == 1
    # The publishers are sealed (no CURVE there: a plain ZeroMQ handshake may succeed), but they admit no
    # subscriber without its token, so nothing reaches the outsider; the heartbeat endpoint refuses it outright.
    assert rep["sockets"] == 8 and rep["received_bytes"] == 0 and rep["handshakes_ok_router"] == 0, rep
    assert rep["handshakes_failed"] >= 5, rep  # every CURVE attempt, and every heartbeat socket, was refused
    assert r["steps"] > 0 and r["equal"] == r["steps"] and r["after"] == 20 and not r["failed"], r
    assert "refused a connection from" in lead.text()  # the ZAP handler said so
    print(
        f"\noutsider: {rep['sockets']} sockets on {len(r['endpoints']['pub']) + 1} endpoints, "
        f"{rep['handshakes_failed']} refused handshakes, {rep['received_bytes']} bytes received; the engine "
        f"ran {r['steps']} correct steps meanwhile"
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first", ["follower", "leader"])
def test_start_order_does_not_matter(first: str) -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        if first == "follower":
            follow = nodes.start(1)
            follow.expect(r"waiting for node 0 at", 60)
            lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:quick")
        else:
            lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:quick")
            lead.expect(r"waiting for 1 other node", 60)
            follow = nodes.start(1)
        assert lead.result("RESULT", 180)["ok"]
        assert lead.wait(60) == 0, lead.text()[-3000:]
        assert follow.wait(30) == 0, follow.text()[-3000:]
        assert "node 0 stopped the cluster" in follow.text()
        assert_nothing_left(sim, [lead, follow])


@pytest.mark.timeout(120)
def test_a_node_started_wrongly_says_how_to_fix_it() -> None:
    with SimulatedCluster(2, use_netns=False) as sim:
        nodes = Nodes(sim)
        no_entry = nodes.start(0, RAYFREE_ENTRY="")
        assert no_entry.wait(60) == 2
        assert "give --entry" in no_entry.text()
        headless_leader = nodes.start(0, RAYFREE_HEADLESS="1")
        assert headless_leader.wait(60) == 2
        assert "cannot be --headless" in headless_leader.text()
        entry_on_follower = nodes.start(1, RAYFREE_ENTRY="x:y")
        assert entry_on_follower.wait(60) == 2
        assert "only its first node (0) runs the entry point" in entry_on_follower.text()


if os.environ.get("CI") and os.geteuid() == 0:  # CI runs as root: the namespaced tests must not skip there
    assert can_use_netns(), "CI as root, but `ip`/`unshare` are missing: the multi-node tests would skip"
