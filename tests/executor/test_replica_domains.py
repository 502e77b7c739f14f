"""Failure domains of DP replicas on one node (NodeReplicas, real workers and gloo worlds): an independent
replica that loses a worker fails alone, with ReplicaLost, while the node's other replica serves on; coupled
ones fail together (ReplicaFailed). Across nodes: tests/cluster/test_dp.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rayfree import ExecutorFailed, ReplicaFailed, ReplicaLost, WorkerDied
from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
from rayfree.executor.replicas import NodeReplicas
from rayfree.transport import get_open_port

ECHO = "tests.support.sample_workers:EchoWorker"


def all_reduce(worker) -> float:
    """A collective over the rank's world (its replica's, or every replica's when coupled)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def start(coupling: str) -> NodeReplicas:
    par = ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, master_port=get_open_port("127.0.0.1"), replica_coupling=coupling
    )
    config = ClusterConfig(parallel=par, ready_timeout_s=120, shutdown_grace_s=1, shutdown_term_s=1)
    return NodeReplicas(config, ECHO, {"distributed": True})


def test_the_coupling_setting_resolves_from_expert_parallelism_and_refuses_what_it_does_not_know() -> None:
    assert not ParallelConfig(data_parallel_size=2).validate().coupled
    assert ParallelConfig(data_parallel_size=2, enable_expert_parallel=True).validate().coupled
    assert not ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, replica_coupling="independent").coupled
    assert ParallelConfig(data_parallel_size=2, replica_coupling="coupled").coupled
    assert not ParallelConfig(replica_coupling="coupled").coupled  # one replica: nothing to couple
    with pytest.raises(ConfigError, match="replica_coupling='loose': use independent, coupled or auto"):
        ParallelConfig(data_parallel_size=2, replica_coupling="loose").validate()


@pytest.mark.timeout(180)
def test_an_independent_replica_that_loses_a_worker_fails_alone_and_the_other_serves_on() -> None:
    reps = start("independent")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        assert ex0.collective_rpc(all_reduce, timeout=60) == [2.0, 2.0]  # a world of its replica's two ranks
        assert ex1.collective_rpc(all_reduce, timeout=60) == [2.0, 2.0]
        heard: list = []
        got = threading.Event()
        ex0.register_replica_callback(lambda k, st: (heard.append((k, st)), got.set()))
        pids0 = [w.proc.pid for w in ex0.workers]
        victim = ex1.workers[1].proc.pid
        os.kill(victim, signal.SIGKILL)
        assert got.wait(30), "replica 0 was not told of replica 1's loss"
        with pytest.raises(ReplicaLost) as lost:
            ex1.collective_rpc("echo", args=(1,), timeout=30)
        assert isinstance(lost.value, ExecutorFailed) and isinstance(lost.value.cause, WorkerDied)
        assert (lost.value.dp_rank, lost.value.node_rank, lost.value.ranks) == (1, 0, [3]), lost.value
        assert "DP replica 1 was lost: node 0, ranks [3]: worker rank 1 died" in str(lost.value)
        for _ in range(20):  # replica 0 serves on, the same processes
            assert ex0.collective_rpc(all_reduce, timeout=30) == [2.0, 2.0]
        assert [w.proc.pid for w in ex0.workers] == pids0 and all(w.proc.is_alive() for w in ex0.workers)
        assert [k for k, _ in heard] == [1] and heard[0][1].state == "lost" and "ranks [3]" in heard[0][1].why
        states = ex0.replica_states()
        assert (states[0].state, states[1].state) == ("serving", "lost"), states
        assert ex1.wait_done(30)
        samples = scrape(reps.liveness)
    finally:
        reps.shutdown()
    assert reps.failure is not None and not reps.liveness.failure  # a replica's, not the node's
    for k, serving, losses in ((0, 1, 0), (1, 0, 1)):
        labels = (("node", "0"), ("replica", str(k)))
        assert samples[("rayfree_replica_serving", labels)] == serving, samples
        assert samples[("rayfree_replica_losses_total", labels)] == losses, samples
        assert (
            samples[("rayfree_replica_rejoins_total", labels)] == 0 and samples[("rayfree_replica_epoch", labels)] == 0
        )


def scrape(liveness) -> dict:
    """This node's /metrics, served and read over HTTP as Prometheus would."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from rayfree.cli.metrics import serve_metrics

    port = get_open_port("127.0.0.1")
    server = serve_metrics(port, liveness, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.timeout(180)
def test_coupled_replicas_fail_together() -> None:
    reps = start("coupled")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        assert ex0.collective_rpc("echo", args=(1,), timeout=60) == [1, 1]
        failed = threading.Event()
        ex0.register_failure_callback(failed.set)
        os.kill(ex1.workers[1].proc.pid, signal.SIGKILL)
        assert failed.wait(30), "replica 0 did not fail with replica 1"
        with pytest.raises(ReplicaFailed, match="DP replica 1 on this node failed"):
            ex0.collective_rpc("echo", args=(1,), timeout=30)
        with pytest.raises(WorkerDied):
            ex1.collective_rpc("echo", args=(1,), timeout=30)
    finally:
        reps.shutdown()
