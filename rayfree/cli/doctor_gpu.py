"""`rayfree doctor` on a GPU node: the devices the workers will get, and what NCCL, CUDA IPC and pinned memory
need from the machine or the container (/dev/shm, the IPC namespace, memlock); and, on every node, whether
the collectives' links (unauthenticated, unencrypted) would cross a public address."""

from __future__ import annotations

import ipaddress
import os
import resource

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.devices import DeviceError, Topology
from rayfree.executor.spawning import node_places, node_topology

from .checks import Check

__all__ = ["gpu_checks", "check_collectives_address", "NCCL_SHM_BYTES"]

#: /dev/shm a GPU node should have beside the queues': NCCL's shared-memory transport takes a few MiB per pair
#: of local ranks and channel, which docker's 64 MB default does not hold for 8 GPUs
NCCL_SHM_BYTES = 1 << 30


def _cpus(cpus: tuple[int, ...] | None) -> str:
    return "not bound" if cpus is None else f"cpus {','.join(map(str, cpus))}"


def check_devices(config: ClusterConfig, topo: Topology) -> Check:
    try:
        visible, places, device, note = node_places(config, topo)
    except DeviceError as e:
        return Check(
            "devices", "FAIL", str(e), "set CUDA_VISIBLE_DEVICES / device_ids, fewer ranks per node, or --device cpu"
        )
    setting = f"device={config.device}" + (" (cpu)" if config.device == "auto" and device == "cpu" else "")
    if not topo.gpus:
        return Check("devices", "ok", f"{setting}: no NVIDIA GPU (the driver lists none): the workers run on the CPU")
    if device == "cpu":
        why = note or f"device={config.device}: no GPU is placed or counted"
        return Check("devices", "ok", f"{setting}: {len(topo.gpus)} GPU(s) on this node; {why}")
    seen = ", ".join(f"{v.spec} ({v.gpu.uuid if v.gpu else 'MIG'}, NUMA {v.numa})" for v in visible)
    workers = "; ".join(f"worker {i}: device {p.device}, {_cpus(p.cpus)}" for i, p in enumerate(places))
    return Check(
        "devices", "ok", f"{setting} (cuda): {len(visible)} visible: {seen}; numa_bind={config.numa_bind}: {workers}"
    )


def check_gpu_shm() -> Check:
    from rayfree.transport.shm.segment import shm_free_bytes

    free = shm_free_bytes() or 0
    detail = f"{free / (1 << 20):.0f} MiB free in /dev/shm for NCCL's shared-memory transport"
    if free < NCCL_SHM_BYTES:
        return Check(
            "nccl shm",
            "FAIL",
            detail + " (docker's default is 64 MB)",
            "compose: shm_size: 16gb, or ipc: host; docker run --shm-size=16g (or NCCL_SHM_DISABLE=1, slower)",
        )
    return Check("nccl shm", "ok", detail)


def check_ipc() -> Check:
    try:
        mine = os.readlink("/proc/self/ns/ipc")
    except OSError:
        return Check("ipc namespace", "warn", "cannot read /proc/self/ns/ipc", "")
    return Check(
        "ipc namespace",
        "ok",
        f"{mine}: this node's workers share it (CUDA IPC between them works); GPUs split over several "
        f"containers of one machine need ipc: host in each",
    )


def check_memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "unlimited (pinned memory, RDMA registration)")
    return Check(
        "memlock",
        "warn",
        f"{soft >> 20} MiB: pinned host memory and RDMA registration need more",
        "compose: ulimits: memlock: -1; docker run --ulimit memlock=-1; Slurm: PropagateResourceLimits",
    )


def check_collectives_address(ip: str) -> Check:
    """torch.distributed's store (node 0's master port) and the collectives' links carry no secret: they must
    stay on a private fabric."""
    from rayfree.transport.net import interface_of

    name = os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    where = f"{ip} on {interface_of(ip) or '?'}" + (f" (socket ifname {name})" if name else "")
    try:
        public = ipaddress.ip_address(ip).is_global
    except ValueError:
        public = False
    if public:
        return Check(
            "collectives",
            "warn",
            f"{where} is a public address: torch.distributed's store and the gloo/NCCL links are neither "
            f"authenticated nor encrypted (the cluster secret does not cover them)",
            "run the nodes on a private network and name it with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME",
        )
    return Check("collectives", "ok", f"{where}: a private address (the store and gloo/NCCL carry no secret)")


def gpu_checks(config: ClusterConfig) -> list[Check]:
    topo = node_topology()
    checks = [check_devices(config, topo)]
    if topo.gpus:
        checks += [check_gpu_shm(), check_ipc(), check_memlock()]
    return checks
