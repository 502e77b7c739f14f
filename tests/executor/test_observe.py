"""A cluster you can see into: `rayfree status` on a running two-node cluster, stall reports naming a
stopped rank, and the Prometheus endpoint counting the calls made. Real nodes, real workers, real sockets."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.cluster.simulate import SimulatedCluster
from rayfree.executor import MultiprocExecutor
from rayfree.transport import get_open_port
from rayfree.transport.secure.policy import SECRET_FILE_ENV, write_secret
from tests.support.nodes import READY_TIMEOUT_S, ROOT, NodeProc, Nodes, shm_files, wait_group_empty
from tests.support.paths import PYTHONPATH

FAST = {
    "RAYFREE_HEARTBEAT_INTERVAL_S": "0.2",
    "RAYFREE_HEARTBEAT_TIMEOUT_S": "2",
    "RAYFREE_SHUTDOWN_GRACE_S": "2",
    "RAYFREE_SHUTDOWN_TERM_S": "2",
    "RAYFREE_READY_TIMEOUT_S": READY_TIMEOUT_S,
}


def _status(sim: SimulatedCluster, node: int, nodes: Nodes, *extra: str, env: dict | None = None):
    """`rayfree status` run on simulated node `node`, with the environment the nodes were started with."""
    argv = [sys.executable, "-m", "rayfree.cli", "status", *extra]
    full = {**nodes.env, **nodes.values, **(env or {})}
    p = sim.nodes[node].popen(argv, env=full, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


@pytest.mark.timeout(240)
def test_status_shows_both_nodes_and_every_rank_of_the_running_demo(tmp_path) -> None:
    with SimulatedCluster(2) as sim:
        nodes = Nodes(sim, **FAST, RAYFREE_DEMO_STEPS="2500")  # long enough for three queries, then a clean stop
        lead = nodes.start(0)
        follow = nodes.start(1)
        lead.expect(r"step 50/", 120)  # running
        code, out, err = _status(sim, 1, nodes, "--json")  # asked from the follower's node
        assert code == 0, err
        st = json.loads(out)
        code_t, table, err_t = _status(sim, 0, nodes)
        other = tmp_path / "other.secret"
        write_secret(str(other))
        code_x, _, err_x = _status(sim, 1, nodes, "--timeout", "2", env={SECRET_FILE_ENV: str(other)})
        assert lead.wait(180) == 0, lead.text()[-3000:]
        assert follow.wait(30) == 0, follow.text()[-3000:]
        for n in (lead, follow):
            assert not wait_group_empty(n.p.pid, 10) and not shm_files(n.node)
    assert st["nnodes"] == 2 and [n["node"] for n in st["nodes"]] == [0, 1]
    for n in st["nodes"]:
        k = n["node"]
        assert n["ip"] == sim.nodes[k].ip and n["state"] == "ok", n
        assert n["ranks"] == [2 * k, 2 * k + 1]
        assert sorted(w["rank"] for w in n["workers"]) == n["ranks"]
        for w in n["workers"]:
            assert w["pid"] > 0 and w["title"].startswith("Worker_PP") and w["state"] != "gone", w
    follower = st["nodes"][1]
    assert 0 <= follower["heartbeat_age_s"] < 2.0 and follower["heartbeat_rtt_ms"] > 0
    (replica,) = st["nodes"][0]["leads"]
    assert len(replica["since_reply_s"]) == 4 and replica["since_reply_s"][2] is not None  # the output rank
    assert replica["ring_chunks"] > 0 and replica["bytes_broadcast"]["shm"] > 0
    assert replica["bytes_broadcast"]["tcp"] > 0  # ranks 2 and 3 are on the other node
    assert code_t == 0, err_t
    print(f"\n$ rayfree status\n{table}")
    for k in (0, 1):
        assert f"{k:<5}{sim.nodes[k].ip:<16}ok" in table, table
    assert "replica 0 (led by node 0)" in table and "broadcast ring:" in table
    # Without the cluster's secret, node 0 says nothing.
    assert code_x == 1 and "did not answer" in err_x


class _Seen(logging.Handler):
    """Collects the executor's warnings; `wait_for` returns the first whose text has every word given."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.records.append((time.monotonic(), record.getMessage()))
            self.cond.notify_all()

    def wait_for(self, words: list[str], timeout: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, msg in self.records:
                    if all(w in msg for w in words):
                        return t, msg
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("force_remote", [False, True], ids=["shm", "socket"])
def test_a_stalled_call_names_the_stopped_rank_and_dumps_its_stack(force_remote: bool) -> None:
    config = ClusterConfig(
        parallel=ParallelConfig(tensor_parallel_size=2),
        ready_timeout_s=120,
        shutdown_grace_s=2,
        shutdown_term_s=2,
        force_remote=force_remote,
        stall_report_s=1.0,
        stall_dump_s=3.0,
    )
    seen = _Seen()
    log = logging.getLogger("rayfree.executor")
    log.addHandler(seen)
    ex = MultiprocExecutor(config, "tests.support.sample_workers:EchoWorker")
    stopped = None
    try:
        assert ex.collective_rpc("echo", args=(1,), timeout=30) == [1, 1]
        stopped = ex.workers[1].proc.pid
        os.kill(stopped, signal.SIGSTOP)
        result: list = []
        t0 = time.monotonic()
        caller = threading.Thread(target=lambda: result.append(ex.collective_rpc("echo", args=(2,), timeout=60)))
        caller.start()
        report = seen.wait_for(["RPC echo has waited", "rank(s) [1]", f"rank 1 (pid {stopped}", "stopped"], 10)
        dump = seen.wait_for(["dumping the Python stacks of rank(s) [1]"], 15)
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        caller.join(60)
        assert not caller.is_alive() and result == [[2, 2]]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        log.removeHandler(seen)
        ex.shutdown()
    assert report is not None, f"no stall report named rank 1 within 10 s: {seen.records}"
    assert report[0] - t0 < 10.0
    print(f"\nstall report after {report[0] - t0:.1f}s: {report[1]}")
    if not force_remote:  # the writer sees in shared memory that rank 1 has not read the call
        assert "rank(s) 1 (1 message(s)) have not read the broadcast ring" in report[1], report[1]
    assert dump is not None and dump[0] - t0 >= config.stall_dump_s, seen.records


@pytest.mark.timeout(180)
def test_the_metrics_endpoint_counts_the_calls_made() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    port = get_open_port("127.0.0.1")
    argv = [
        sys.executable,
        "-m",
        "rayfree.cli",
        "node",
        "--nnodes",
        "1",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "1",
        "--worker",
        "rayfree.cli.toy_engine:ToyWorker",
        "--entry",
        "tests.support.multinode_entry:calls_then_serve",
        "--metrics-port",
        str(port),
        "--master-addr",
        "127.0.0.1",
    ]
    with SimulatedCluster(1, use_netns=False) as sim:
        node = NodeProc(
            sim.nodes[0], argv, {"PYTHONPATH": PYTHONPATH, "RF_CALLS": "25", "RAYFREE_FORCE_REMOTE": "0", **FAST}
        ).start()
        called = node.result("CALLED", 120)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        node.p.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0, node.text()[-3000:]
        assert not wait_group_empty(node.p.pid, 10)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    key = (("method", "execute_model"), ("node", "0"), ("replica", "0"))
    assert samples[("rayfree_rpc_latency_seconds_count", key)] == called["calls"] == 25, text
    assert samples[("rayfree_rpc_latency_seconds_bucket", tuple(sorted({**dict(key), "le": "+Inf"}.items())))] == 25
    assert 0 < samples[("rayfree_rpc_latency_seconds_sum", key)] < 25 * 10
    assert samples[("rayfree_broadcast_bytes_total", (("node", "0"), ("path", "shm"), ("replica", "0")))] > 0
    assert samples[("rayfree_workers_alive", (("node", "0"),))] == 2
    assert samples[("rayfree_rpc_in_flight", (("node", "0"), ("replica", "0")))] == 0
