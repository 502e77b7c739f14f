"""The broadcast across nodes: once per node through each node's relay, a tree past the fan-out, flat on request.

Simulated nodes (network namespaces, one /dev/shm each), the full executor started as compose starts it; the
bytes are node 0's own interface counter, so a copy sent is a copy counted. The leader's entry points are in
tests/support/multinode_entry.py.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from tests.cluster.test_multinode import FAST, HB_TIMEOUT, SLACK, assert_nothing_left
from tests.support.nodes import Nodes

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")


def _run(sim: SimulatedCluster, entry: str, **env: str) -> dict:
    nodes = Nodes(sim, **FAST, RAYFREE_NNODES=str(len(sim.nodes)), **env)
    lead = nodes.start(0, RAYFREE_ENTRY=f"tests.support.multinode_entry:{entry}")
    others = [nodes.start(k) for k in range(1, len(sim.nodes))]
    r = lead.result("RESULT", 200)
    assert lead.wait(60) == 0, lead.text()[-3000:]
    for o in others:
        assert o.wait(30) == 0, o.text()[-3000:]
    assert_nothing_left(sim, [lead, *others])
    return r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broadcast", ["relay", "flat", "relay-insecure"])
def test_tp4_over_two_nodes_sends_each_broadcast_out_of_node_0_once(broadcast: str) -> None:
    """Two ranks on node 1: the relay takes one copy for both; flat, each rank takes its own. Sealed, and
    (relay-insecure) with sequence numbers only, on a trusted network."""
    insecure = {"RAYFREE_SECRET_FILE": "", "RAYFREE_INSECURE": "1"} if broadcast.endswith("insecure") else {}
    broadcast = broadcast.split("-")[0]
    with SimulatedCluster(2) as sim:
        r = _run(
            sim,
            "relay_bytes",
            RAYFREE_BROADCAST=broadcast,
            RAYFREE_TENSOR_PARALLEL_SIZE="4",
            RAYFREE_PIPELINE_PARALLEL_SIZE="1",
            **insecure,
        )
    assert r["equal"] == r["steps"] and r["lens_ok"], r
    assert r["sealed"] == (not insecure), r
    # 1 MiB copies plus TCP/IP headers (~3%) and the heartbeats meanwhile
    if broadcast == "relay":
        assert 0.95 <= r["copies"] <= 1.2, r
        (relay,) = r["relays"]
        assert (
            relay["node"] == 1 and relay["children"] == [] and relay["parent"].startswith(f"tcp://{sim.nodes[0].ip}:")
        )
        assert relay["forwarded_bytes"] == 0 and relay["relayed_bytes"] >= 23 << 20, relay
    else:
        assert 1.95 <= r["copies"] <= 2.3, r
        assert r["relays"] == [], r
    print(f"\n{broadcast}: node 0 sent {r['copies']:.3f} x 1 MiB per 1 MiB broadcast to 2 ranks on node 1")


@pytest.mark.timeout(400)
def test_four_nodes_with_fan_out_2_form_a_tree() -> None:
    """Nodes 1 and 2 hear node 0; node 3 hears node 1, which passes each wire message on unchanged."""
    with SimulatedCluster(4) as sim:
        r = _run(
            sim,
            "relay_bytes",
            RAYFREE_RELAY_FANOUT="2",
            RAYFREE_TENSOR_PARALLEL_SIZE="4",
            RAYFREE_PIPELINE_PARALLEL_SIZE="1",
        )
    assert r["equal"] == r["steps"] and r["lens_ok"], r
    assert 1.95 <= r["copies"] <= 2.3, r  # two copies leave node 0, whatever the node count
    # one rank per node: only node 1 runs a relay (it feeds node 3); nodes 2 and 3 subscribe to their parents
    (relay,) = r["relays"]
    assert relay["node"] == 1 and relay["children"] == [3], relay
    assert relay["parent"].startswith(f"tcp://{sim.nodes[0].ip}:"), relay
    # node 1 passed on everything it received (the sealed wire bytes: a little over what it wrote to its ring)
    assert relay["forwarded_bytes"] >= relay["relayed_bytes"] >= 23 << 20, relay
    info = {x["rank"]: x for x in r["info"]}
    assert [info[k]["broadcast"] for k in range(4)] == ["shm", "relay", "tcp", "tcp"], info
    print(
        f"\n4 nodes, fan-out 2: node 0 sent {r['copies']:.3f} x 1 MiB per broadcast; node 1 forwarded "
        f"{relay['forwarded_bytes'] / relay['relayed_bytes']:.3f} x what it relayed"
    )


@pytest.mark.timeout(300)
def test_a_relay_node_killed_mid_run_fails_the_cluster_naming_it() -> None:
    """Four nodes, fan-out 2: node 1 (which feeds node 3) dies while every rank is in a call. The leader names
    node 1 as lost; node 3, whose stream came through node 1, is stopped by the cluster, not left waiting."""
    with SimulatedCluster(4) as sim:
        nodes = Nodes(
            sim,
            **FAST,
            RAYFREE_NNODES="4",
            RAYFREE_RELAY_FANOUT="2",
            RAYFREE_TENSOR_PARALLEL_SIZE="4",
            RAYFREE_PIPELINE_PARALLEL_SIZE="1",
            RAYFREE_STALL_REPORT_S="1",
        )
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:hang")
        relay, beside, below = nodes.start(1), nodes.start(2), nodes.start(3)
        lead.result("PENDING", 200)
        # the stall report names the relay a waiting rank's stream comes through, and how far it is behind
        stall = lead.expect(r"RPC nap has waited .*node 1's relay has written (\d+) message\(s\) into its ring", 30)
        assert int(stall.group(1)) >= 1
        t_lost = time.monotonic()
        sim.nodes[1].kill(signal.SIGKILL)
        r = lead.result("RESULT", 60)
        assert lead.wait(60) == 1, lead.text()[-3000:]
        assert below.wait(HB_TIMEOUT + 20) == 1, below.text()[-3000:]
        t_below = time.monotonic() - t_lost
        assert beside.wait(HB_TIMEOUT + 20) == 1, beside.text()[-3000:]
        relay.wait(10)
        assert_nothing_left(sim, [lead, relay, beside, below])
    took = r["t_fail"] - t_lost
    assert r["kind"] == "NodeLost+ExecutorFailed", r
    assert "node 1 (" in r["error"] and "ranks [1]" in r["error"], r["error"]
    assert took <= HB_TIMEOUT + SLACK, f"the pending call failed {took:.2f}s after the relay node was killed"
    print(
        f"\nrelay node killed: the leader's call failed after {took:.2f} s; the node below it exited after "
        f"{t_below:.2f} s"
    )


@pytest.mark.timeout(200)
def test_nodes_that_broadcast_differently_are_told_so() -> None:
    """Node 0 relays, node 1 was started flat: both are told which node says what, instead of a handshake
    that waits out its timeout."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST)
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:quick")
        follow = nodes.start(1, RAYFREE_BROADCAST="flat")
        assert lead.wait(120) != 0, lead.text()[-3000:]
        assert follow.wait(60) != 0, follow.text()[-3000:]
        assert_nothing_left(sim, [lead, follow])
    said = "node 0: broadcast=relay relay_fanout=8, node 1: broadcast=flat relay_fanout=8"
    for n in (lead, follow):
        assert "the nodes disagree on how broadcasts travel" in n.text() and said in n.text(), n.text()[-3000:]


@pytest.mark.timeout(300)
def test_a_relay_cut_off_its_stream_after_start_up_stops_its_node_cleanly() -> None:
    """Node 1's relay loses its TCP stream from node 0 mid-call, while the heartbeats go on (no verdict): the
    relay's thread reports it, and the stop that follows closes the relay from that thread's report without
    joining itself (it raised RuntimeError before, so the relay's ring and sockets were never released). Node 1
    exits 1 naming its relay, the leader's pending call fails, nothing is left."""
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST, RAYFREE_TENSOR_PARALLEL_SIZE="4", RAYFREE_PIPELINE_PARALLEL_SIZE="1")
        lead = nodes.start(0, RAYFREE_ENTRY="tests.support.multinode_entry:cut_stream")
        follow = nodes.start(1)
        endpoint = lead.result("STREAM", 200)["endpoint"]
        port = endpoint.rsplit(":", 1)[1]
        cut = sim.nodes[1].popen(
            ["ss", "-K", "dst", sim.nodes[0].ip, "dport", "=", f":{port}"], stdout=subprocess.PIPE, text=True
        )
        out, _ = cut.communicate(timeout=10)
        assert cut.returncode == 0 and f":{port}" in out, out
        r = lead.result("RESULT", 60)
        assert follow.wait(30) == 1, follow.text()[-3000:]
        assert lead.wait(30) == 1, lead.text()[-3000:]
        assert_nothing_left(sim, [lead, follow])
    text = follow.text()
    assert "relay 2" in text, text[-3000:]
    assert "cannot join current thread" not in text and "Traceback" not in text, text[-3000:]
    assert r["kind"] and "node 1" in r["error"], r
    print(f"\nthe leader's pending call: {r['kind']}: {r['error'][:200]}")
