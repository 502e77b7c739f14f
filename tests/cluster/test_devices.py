"""Placing a node's workers on its GPUs and CPUs, from a GPU node's files (a tree of the test's own): integers,
UUIDs and MIG ids in CUDA_VISIBLE_DEVICES, a subset by device_ids, disjoint devices for DP replicas, the count
checked, CPUs split by NUMA node."""

from __future__ import annotations

import re

import pytest

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.devices import DeviceError, Topology, parse_cpulist, place, visible_devices
from tests.support.topology import fake_topology, uuid_of

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def node8(tmp_path) -> Topology:
    """Eight GPUs, four on each of two NUMA nodes of 8 CPUs each (hyperthreads listed apart)."""
    fake_topology(tmp_path, [0, 0, 0, 0, 1, 1, 1, 1], {0: "0-3,16-19", 1: "4-7,20-23"})
    return Topology.read(str(tmp_path))


def test_the_driver_files_give_gpus_in_pci_order_with_their_numa_node(node8: Topology) -> None:
    assert [g.index for g in node8.gpus] == list(range(8))
    assert node8.gpus[5].uuid == uuid_of(5) and node8.gpus[5].pci == "0000:15:00.0" and node8.gpus[5].numa == 1
    assert node8.numa_cpus == {0: [0, 1, 2, 3, 16, 17, 18, 19], 1: [4, 5, 6, 7, 20, 21, 22, 23]}
    assert parse_cpulist("0-1,4,6-7") == [0, 1, 4, 6, 7]


def test_a_node_without_the_nvidia_driver_has_no_gpus(tmp_path) -> None:
    topo = Topology.read(str(tmp_path))
    assert topo.gpus == [] and visible_devices(topo, {}) == [] == visible_devices(topo, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(DeviceError, match="has no NVIDIA GPU"):
        visible_devices(topo, {}, "0")
    assert [p.device for p in place(topo, [], 3)] == [None, None, None]


@pytest.mark.parametrize(
    "cvd, want",
    [
        (None, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("6,2", [6, 2]),
        (f"{uuid_of(3)},{uuid_of(1)[:12]}", [3, 1]),  # a UUID, and a prefix of one (CUDA accepts both)
        (f"MIG-{uuid_of(4)}/1/0", [4]),  # the old MIG form names its parent GPU
        ("", []),
    ],
)
def test_visible_devices_are_read_as_cuda_reads_them(node8: Topology, cvd, want) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert [v.gpu.index for v in visible_devices(node8, env)] == want


def test_a_mig_instance_by_its_own_uuid_is_placed_without_a_numa_node(node8: Topology) -> None:
    mig = "MIG-5c3b2a19-8f7e-5d6c-9b4a-3e2f1d0c9b8a"
    (v,) = visible_devices(node8, {"CUDA_VISIBLE_DEVICES": mig})
    assert v.spec == mig and v.gpu is None and v.numa == -1
    (p,) = place(node8, [v], 1, numa_bind="auto")
    assert p.device == 0 and p.cpus is None


@pytest.mark.parametrize(
    "cvd, says",
    [("0,9", "device 9 does not exist (8 GPU(s)"), ("GPU-ffff", "matches no GPU"), ("gpu0", "is not a device index")],
)
def test_a_visible_device_the_node_does_not_have_is_named(node8: Topology, cvd, says) -> None:
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES=.*" + re.escape(says)):
        visible_devices(node8, {"CUDA_VISIBLE_DEVICES": cvd})


def test_device_ids_choose_a_subset_by_position_or_uuid(node8: Topology) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1,3,5,7"}
    assert [v.gpu.index for v in visible_devices(node8, env, "2,0")] == [5, 1]
    assert [v.gpu.index for v in visible_devices(node8, env, uuid_of(7))] == [7]
    with pytest.raises(DeviceError, match="position 4 is past the 4 device"):
        visible_devices(node8, env, "4")
    with pytest.raises(DeviceError, match="not among this node's visible devices"):
        visible_devices(node8, env, uuid_of(0))


def test_each_worker_gets_its_own_device_by_index_and_no_cuda_visible_devices(node8: Topology) -> None:
    vis = visible_devices(node8, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    places = place(node8, vis, 4)
    assert [p.device for p in places] == [0, 1, 2, 3]
    assert all(p.env == {"RAYFREE_LOCAL_DEVICE": str(p.device)} for p in places)  # the env is left whole
    asked = place(node8, vis, 4, per_rank_visible_devices=True)
    assert [(p.device, p.env["CUDA_VISIBLE_DEVICES"]) for p in asked] == [(0, "4"), (0, "5"), (0, "6"), (0, "7")]


def test_more_ranks_than_devices_is_refused_naming_both(node8: Topology) -> None:
    vis = visible_devices(node8, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    with pytest.raises(DeviceError, match=r"node 3 runs 4 worker\(s\) but sees 3 device\(s\) \(0, 1, 2\)"):
        place(node8, vis, 4, node=3)


def test_numa_auto_binds_each_worker_to_its_gpus_node_and_splits_the_cpus(node8: Topology) -> None:
    vis = visible_devices(node8, {"CUDA_VISIBLE_DEVICES": "0,1,4,5"})
    places = place(node8, vis, 4, numa_bind="auto")
    assert [p.numa for p in places] == [0, 0, 1, 1]
    assert [p.cpus for p in places] == [(0, 1, 2, 3), (16, 17, 18, 19), (4, 5, 6, 7), (20, 21, 22, 23)]
    assert [p.cpus for p in place(node8, vis, 4)] == [None] * 4  # numa_bind="none": the default
    assert [p.numa for p in place(node8, vis, 4, numa_bind="1,0")] == [1, 0, 1, 0]
    with pytest.raises(DeviceError, match="NUMA node 2 does not exist"):
        place(node8, vis, 2, numa_bind="2")


def test_a_nic_per_device_is_set_for_that_worker_alone(node8: Topology) -> None:
    vis = visible_devices(node8, {})
    places = place(node8, vis, 2, gpu_nics="mlx5_0,mlx5_1")
    assert [p.env["NCCL_IB_HCA"] for p in places] == ["=mlx5_0", "=mlx5_1"]


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("numa_bind", "near", "numa_bind='near': use auto, none"),
        ("device_ids", " , ", "device_ids=' , ': name at least one device"),
        ("gpu_nics", "mlx5_0,,mlx5_1", "one NIC name per device"),
    ],
)
def test_a_device_setting_that_cannot_parse_is_refused_by_name(field, value, says) -> None:
    with pytest.raises(ConfigError, match=says):
        ClusterConfig(**{field: value}).validate()


def test_the_placement_code_never_imports_torch() -> None:
    """The node decides devices from files: a parent that asks CUDA before it starts workers breaks them."""
    import ast
    import inspect

    import rayfree.cluster.devices as devices

    tree = ast.parse(inspect.getsource(devices))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(n.split(".")[0] == "torch" for n in names), names


def test_cuda_is_asked_in_the_worker_alone() -> None:
    """No node process, executor or CLI code touches torch.cuda: a parent that initialises CUDA before it starts
    its workers breaks them (vllm#15681). The worker's own init_device is the one place."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    users = []
    for folder in ("transport", "cluster", "worker", "executor", "rayfree"):
        for dirpath, _, files in os.walk(os.path.join(root, folder), followlinks=False):
            if os.path.islink(dirpath) or "integrations" in dirpath:  # (vLLM's worker is vLLM's)
                continue
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path) as fh:
                        if "torch.cuda" in fh.read():
                            users.append(os.path.relpath(path, root))
    assert users == ["worker/base.py"], users


def test_the_cpus_a_node_may_use_bound_the_split(node8: Topology) -> None:
    """In a container whose cpuset holds only some CPUs, a worker is bound among those alone."""
    vis = visible_devices(node8, {"CUDA_VISIBLE_DEVICES": "0,4"})
    cut = node8.within({0, 1, 4})
    assert [p.cpus for p in place(cut, vis, 2, numa_bind="auto")] == [(0, 1), (4,)]
    with pytest.raises(DeviceError, match="none of its CPUs is this node's to use"):
        place(node8.within({0, 1}), vis, 2, numa_bind="auto")
