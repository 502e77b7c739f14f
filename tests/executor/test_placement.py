"""Workers placed by the node on a GPU node's devices and CPUs (its files given as a tree of the test's own), with
the node's environment reaching them unchanged, and every group built as a cpu/device pair."""

from __future__ import annotations

import os

import pytest

from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
from rayfree.cluster.environment import LAUNCHER_VARIABLES
from rayfree.executor import MultiprocExecutor
from rayfree.executor.replicas import NodeReplicas
from rayfree.executor.status_messages import worker_statuses
from rayfree.transport import get_open_port
from tests.support.topology import fake_topology

ECHO = "tests.support.sample_workers:EchoWorker"
#: what rayfree documents it sets in a worker (docs/gpu.md, docs/workers.md); everything else is the node's
SET_BY_RAYFREE = {*LAUNCHER_VARIABLES, "RAYFREE_LOCAL_DEVICE", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS"}
#: not rayfree's: GNU readline, once a process imports it (pytest's pdb does, without xdist), exports the
#: terminal's size into the C environment, which children inherit and os.environ never shows
READLINE = {"LINES", "COLUMNS"}
#: what NCCL, UCX, NVSHMEM and the NIC selection read: must arrive exactly as the node has them
FABRIC = {
    "NCCL_SOCKET_IFNAME": "=lo",
    "NCCL_IB_HCA": "mlx5_0:1,mlx5_3:1",
    "NCCL_DEBUG": "INFO",
    "UCX_NET_DEVICES": "mlx5_0:1",
    "UCX_TLS": "rc,sm,self",
    "NVSHMEM_REMOTE_TRANSPORT": "ibrc",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}


def placement_of(worker) -> dict:
    return {
        "device": worker.device_index,
        "cpus": sorted(os.sched_getaffinity(0)),
        "env": dict(os.environ),
        "torch_device": str(worker.device),
    }


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """Two GPUs, one per NUMA node; NUMA node n has CPU n (both CPUs of this machine are real)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to bind two workers apart")
    monkeypatch.setenv("RAYFREE_TOPOLOGY_ROOT", str(fake_topology(tmp_path, [0, 1], {0: "0", 1: "1"})))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    for k, v in FABRIC.items():
        monkeypatch.setenv(k, v)


@pytest.mark.timeout(120)
def test_each_worker_runs_on_its_device_and_its_numa_nodes_cpus_with_the_nodes_environment(two_gpus) -> None:
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), numa_bind="auto")
    with MultiprocExecutor(config, ECHO, {"distributed": True}) as ex:
        got = ex.collective_rpc(placement_of, timeout=60)
        shown = [(w.device, w.cpus) for w in worker_statuses(ex)]  # what `rayfree status` shows of them
    assert [(g["device"], g["cpus"]) for g in got] == [(0, [0]), (1, [1])], got
    assert shown == [(0, "0"), (1, "1")], shown
    assert [g["torch_device"] for g in got] == ["cpu", "cpu"]  # (no CUDA on this machine)
    node = dict(os.environ)
    for g in got:
        env = g["env"]
        assert {k: env.get(k) for k in FABRIC} == FABRIC
        assert "CUDA_VISIBLE_DEVICES" not in env  # never per rank unless asked
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # device ids follow the driver's (nvidia-smi's) order
        differ = {k for k in node.keys() | env.keys() if node.get(k) != env.get(k)}
        extra = {k: (node.get(k), env.get(k)) for k in differ - SET_BY_RAYFREE - READLINE}
        assert not extra, f"the worker's environment differs from its node's (node, worker): {extra}"
    assert os.sched_getaffinity(0) >= {0, 1}  # the node's own threads are not bound


@pytest.mark.timeout(120)
def test_a_worker_gets_its_own_cuda_visible_devices_only_when_asked(two_gpus) -> None:
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), per_rank_visible_devices=True)
    with MultiprocExecutor(config, ECHO) as ex:
        got = ex.collective_rpc(placement_of, timeout=60)
    assert [(g["device"], g["env"]["CUDA_VISIBLE_DEVICES"], len(g["cpus"])) for g in got] == [(0, "0", 2), (0, "1", 2)]


@pytest.mark.timeout(60)
def test_more_ranks_than_devices_is_refused_before_any_worker_starts_with_device_cuda(two_gpus) -> None:
    import multiprocessing

    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=4), device="cuda")
    with pytest.raises(ConfigError, match=r"node 0 runs 4 worker\(s\) but sees 2 device\(s\) \(device=cuda\)") as e:
        MultiprocExecutor(config, ECHO)
    assert "\n" not in str(e.value) and "refused before starting any worker" in str(e.value)
    assert "--device cpu" in str(e.value)
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
def test_device_auto_runs_more_ranks_than_gpus_on_the_cpu_and_says_so(two_gpus, caplog) -> None:
    """A CPU engine (or the demo) on a box with too few GPUs: device=auto places none of them, counts nothing,
    and says so in one line; each worker's `self.device` is the CPU."""
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=4))
    with caplog.at_level("WARNING", logger="rayfree.executor"):
        with MultiprocExecutor(config, ECHO, {"distributed": True}) as ex:
            got = ex.collective_rpc(placement_of, timeout=60)
    assert [g["device"] for g in got] == [None] * 4 and [g["torch_device"] for g in got] == ["cpu"] * 4, got
    assert all("RAYFREE_LOCAL_DEVICE" not in g["env"] and "CUDA_DEVICE_ORDER" not in g["env"] for g in got)
    said = [r.getMessage() for r in caplog.records if "run on the CPU" in r.getMessage()]
    assert said == ["node 0 runs 4 worker(s) but sees 2 GPU(s): they run on the CPU (device=auto; --device cuda "
                    "refuses instead)"], said  # fmt: skip


@pytest.mark.timeout(120)
def test_device_cpu_and_a_cpu_worker_class_place_no_gpu_whatever_the_node_has(two_gpus) -> None:
    """device=cpu, and a worker class that declares runs_on = "cpu" (read from its class body, its module not
    imported here): no GPU placed although there is one for each worker. A setting that contradicts the class
    is refused in one line."""
    for config, worker in (
        (ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), device="cpu"), ECHO),
        (ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2)), "tests.support.sample_workers:CpuEchoWorker"),
    ):
        with MultiprocExecutor(config, worker, {"distributed": True}) as ex:
            got = ex.collective_rpc(placement_of, timeout=60)
        assert [(g["device"], g["torch_device"]) for g in got] == [(None, "cpu")] * 2, (worker, got)
        assert all("RAYFREE_LOCAL_DEVICE" not in g["env"] for g in got)
    wrong = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), device="cuda")
    with pytest.raises(ConfigError, match=r"device='cuda' but the worker class runs on 'cpu' only"):
        MultiprocExecutor(wrong, "tests.support.sample_workers:CpuEchoWorker")


def test_the_device_setting_resolves_as_the_docs_say() -> None:
    from rayfree.cluster.devices import DeviceError, resolve_device

    assert resolve_device("auto", 0, 2) == ("cpu", "")  # (no GPU: the CPU, nothing to say)
    assert resolve_device("auto", 8, 2) == ("cuda", "")
    assert resolve_device("auto", 1, 2)[0] == "cpu" and "sees 1 GPU(s): they run on the CPU" in resolve_device(
        "auto", 1, 2)[1]  # fmt: skip
    assert resolve_device("cpu", 8, 2) == ("cpu", "")
    assert resolve_device("cuda", 2, 2) == ("cuda", "")
    with pytest.raises(DeviceError, match=r"runs 2 worker\(s\) but sees 0 device\(s\) \(device=cuda\)"):
        resolve_device("cuda", 0, 2)
    with pytest.raises(ConfigError, match="device='gpu': use auto, cpu or cuda"):
        ClusterConfig(device="gpu").validate()


@pytest.mark.timeout(180)
def test_dp_replicas_on_one_node_get_disjoint_devices(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYFREE_TOPOLOGY_ROOT", str(fake_topology(tmp_path, [0, 0, 0, 0], {0: "0-1"})))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2,1,0")
    par = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, master_port=get_open_port("127.0.0.1"))
    reps = NodeReplicas(ClusterConfig(parallel=par, ready_timeout_s=120), ECHO, {"distributed": True})
    try:
        seen = {ex.dp_rank: [g["device"] for g in ex.collective_rpc(placement_of, timeout=60)] for ex in reps.leaders}
    finally:
        reps.shutdown()
    assert seen == {0: [0, 1], 1: [2, 3]}, seen


def paired_groups(worker) -> dict:
    import torch
    import torch.distributed as dist

    from rayfree.cluster.parallel_state import get_tp_group, get_world_group

    out = {}
    for name, g in (("tp", get_tp_group()), ("world", get_world_group())):
        t = torch.tensor([float(worker.rank + 1)])
        dist.all_reduce(t, group=g.device_group)
        out[name] = (g.device_group is not g.cpu_group, t.item(), dist.get_backend(g.device_group))
    return out


@pytest.mark.timeout(120)
def test_every_group_is_a_cpu_group_and_a_device_group_of_the_same_ranks() -> None:
    """The path a GPU worker takes with NCCL, here with gloo as the device backend: the collectives on the
    device groups sum over the group's ranks, apart from the control plane's groups."""
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    with MultiprocExecutor(config, "tests.support.sample_workers:PairedGroupsWorker", {"distributed": True}) as ex:
        got = ex.collective_rpc(paired_groups, timeout=60)
    for rank, g in enumerate(got):
        tp_sum = 3.0 if rank < 2 else 7.0  # ranks {0,1} and {2,3}, each adding rank + 1
        assert g["tp"] == (True, tp_sum, "gloo") and g["world"] == (True, 10.0, "gloo"), (rank, g)
    with MultiprocExecutor(
        ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2)), ECHO, {"distributed": True}
    ) as ex:
        plain = ex.collective_rpc(paired_groups, timeout=60)
    assert [g["tp"][0] for g in plain] == [False, False]  # on CPU, without a device backend: one gloo group
