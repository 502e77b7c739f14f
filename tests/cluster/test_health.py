"""`rayfree node --health-port`: /livez and /readyz on every node of three simulated nodes, probed from inside
each node as a kubelet would; a node killed, a worker killed, a rank stopped; the restart contract.

The probes poll every 50 ms and print each change with CLOCK_MONOTONIC (one clock for every namespace), so
the latencies below are measured from the moment the test acted. Default heartbeats (0.5 s, 3 s).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from rayfree.procs import cmdline, group_members, stat_fields
from tests.support.nodes import NodeProc, shm_files, until_unready, wait_group_empty
from tests.support.paths import PYTHONPATH

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")

PORT = 8480
#: "within 1 s" on an idle machine; this one has two cores shared with the rest of the suite
SLACK = 1.0
ENV = {
    "PYTHONPATH": PYTHONPATH,
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "RAYFREE_LOG_LEVEL": "INFO",
    "RAYFREE_STALL_REPORT_S": "2",
}


def node_argv(sim: SimulatedCluster, k: int) -> list[str]:
    role = ["--entry", "tests.support.multinode_entry:busy"] if k == 0 else ["--headless"]
    return [
        sys.executable, "-m", "rayfree.cli", "node", "--worker", "tests.support.sample_workers:EchoWorker",
        "--tp", "3", "--nnodes", "3", "--node-rank", str(k), "--master-addr", sim.nodes[0].ip,
        "--master-port", "29500", "--insecure", "--health-port", str(PORT),
        "--worker-kwargs", '{"distributed": true}', *role,
    ]  # fmt: skip


def start_cluster(sim: SimulatedCluster) -> list[NodeProc]:
    procs: list[NodeProc] = []
    for k in range(3):
        procs.append(NodeProc(sim.nodes[k], node_argv(sim, k), ENV).start())
        procs[-1].others = procs
    return procs


def probe(sim: SimulatedCluster, k: int, path: str = "readyz") -> NodeProc:
    return NodeProc(
        sim.nodes[k], [sys.executable, "-m", "tests.support.probe", f"http://127.0.0.1:{PORT}/{path}"], ENV
    ).start()


def until(p: NodeProc, code: int, timeout: float) -> tuple[float, dict]:
    """The probe's next change to `code`: when, and the JSON it answered."""
    m = p.expect(rf"^PROBE {code} (\S+) (.*)$", timeout)
    return float(m.group(1)), json.loads(m.group(2))


def workers_of(node: NodeProc) -> list[int]:
    """The worker processes a `rayfree node` started (its children titled rayfree::Worker_...)."""
    return [
        pid
        for pid in group_members(node.p.pid)
        if (f := stat_fields(pid)) and f[1] == str(node.p.pid) and "rayfree::Worker" in cmdline(pid, 400)
    ]


def nothing_left(sim: SimulatedCluster, nodes: list[NodeProc]) -> None:
    for n in nodes:
        assert not wait_group_empty(n.p.pid, 15), f"node {n.node.index}: processes left\n{n.text()[-2000:]}"
        assert not shm_files(n.node), f"node {n.node.index}: {shm_files(n.node)}"


def live_probe(sim: SimulatedCluster, k: int) -> NodeProc:
    """Node k's /livez, once it answers 200."""
    p = probe(sim, k, "livez")
    until(p, 200, 30)
    return p


def ready_cluster(sim: SimulatedCluster) -> tuple[list[NodeProc], list[NodeProc], float]:
    t = time.monotonic()
    nodes = start_cluster(sim)
    probes = [probe(sim, k) for k in range(3)]
    nodes[0].expect("^SERVING:", 120)
    ready_at = max(until(p, 200, 60)[0] for p in probes)
    return nodes, probes, ready_at - t


@pytest.mark.timeout(300)
def test_a_killed_node_turns_every_survivors_readyz_503_and_every_node_exits_then_the_same_commands_restart() -> None:
    with SimulatedCluster(3) as sim:
        nodes, probes, first_ready = ready_cluster(sim)
        live = live_probe(sim, 1)
        t0 = time.monotonic()
        sim.nodes[2].kill()
        t_n0, why0 = until_unready(probes[0], nodes[0], 10)
        t_n1, why1 = until_unready(probes[1], nodes[1], 10)
        assert "node 2" in why0 and "node 2" in why1, (why0, why1)
        live.expect(r"^PROBE (503|0) ", 10)  # node 1 itself fails (then its port closes): not alive
        codes = [nodes[k].wait(30) for k in (0, 1)]
        t_out = time.monotonic() - t0
        assert codes[0] != 0 and codes[1] != 0, codes
        assert "node 2" in nodes[1].text()
        nothing_left(sim, nodes[:2])
        # the same commands again, on every node: the cluster forms at once (no port or state in the way)
        t1 = time.monotonic()
        again, probes2, _ = ready_cluster(sim)
        t_back = time.monotonic() - t1
        sim.kill_all()
    print(
        f"\n/readyz 503 after a node kill: node 0 {t_n0 - t0:.3f} s, node 1 {t_n1 - t0:.3f} s; every node out "
        f"{t_out:.2f} s after the kill (codes {codes}); first start {first_ready:.1f} s, restart to ready "
        f"{t_back:.1f} s"
    )
    assert t_n0 - t0 < 1.0 + SLACK and t_n1 - t0 < 1.0 + SLACK
    assert t_out < 15


@pytest.mark.timeout(240)
def test_a_killed_worker_turns_readyz_503_on_node_0_and_the_other_follower() -> None:
    with SimulatedCluster(3) as sim:
        nodes, probes, _ = ready_cluster(sim)
        victim = workers_of(nodes[1])
        assert len(victim) == 1, victim
        t0 = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        t_n0, why0 = until_unready(probes[0], nodes[0], 10)
        t_n2, why2 = until_unready(probes[2], nodes[2], 10)
        assert "rank 1" in why0 or "node 1" in why0, why0
        assert all(nodes[k].wait(30) != 0 for k in range(3))
        nothing_left(sim, nodes)
    print(f"\n/readyz 503 after a worker kill: node 0 {t_n0 - t0:.3f} s, node 2 {t_n2 - t0:.3f} s ({why2[-300:]})")
    assert t_n0 - t0 < 1.0 + SLACK and t_n2 - t0 < 1.0 + SLACK


@pytest.mark.timeout(240)
def test_a_stopped_rank_turns_readyz_503_within_stall_report_s_and_200_once_it_runs_again() -> None:
    with SimulatedCluster(3) as sim:
        nodes, probes, _ = ready_cluster(sim)
        live = live_probe(sim, 0)
        victim = workers_of(nodes[2])
        t0 = time.monotonic()
        os.kill(victim[0], signal.SIGSTOP)
        try:
            t_n0, why0 = until(probes[0], 503, 10)
            t_n1, _ = until(probes[1], 503, 10)
        finally:
            os.kill(victim[0], signal.SIGCONT)
        t_back, _ = until(probes[0], 200, 30)
        lived = live.text()  # before the teardown kills node 0
        sim.kill_all()
    assert lived.count("PROBE") == 1, lived  # node 0 itself stayed alive throughout
    print(
        f"\n/readyz 503 after SIGSTOP of rank 2: node 0 {t_n0 - t0:.3f} s ({why0['reason']}), node 1 {t_n1 - t0:.3f} s"
    )
    assert "rank 2" in why0["reason"], why0
    assert t_n0 - t0 < 2.0 + SLACK and t_n1 - t0 < 2.0 + SLACK  # stall_report_s=2
    assert t_back > t0


@pytest.mark.timeout(60)
def test_a_probe_that_hangs_up_early_leaves_no_traceback_in_the_node_log(capfd) -> None:
    """A probe that disconnects before its answer (a kubelet's timeout, a load balancer's check) is not an error:
    the node's log gets no BrokenPipeError traceback, and the next probe is answered."""
    import socket
    import struct
    import urllib.request

    from rayfree.cli.probes import HealthServer
    from rayfree.transport import get_open_port

    port = get_open_port("127.0.0.1")
    server = HealthServer(port, 0)
    try:
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # (a reset, not a FIN)
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=10) as r:
            assert r.status in (200, 503)
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "ConnectionResetError" not in err, err
