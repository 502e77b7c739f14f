"""Which GPU each worker of a node gets and which CPUs it runs on, decided by the node process before any
worker starts.

It reads what the node sees from files only: the driver's `/proc/driver/nvidia/gpus/*/information` (index
order is PCI bus order, as nvidia-smi's), `/sys/bus/pci/devices/*/numa_node` and the NUMA nodes' cpulists,
and `CUDA_VISIBLE_DEVICES` (integers, GPU UUIDs or their prefixes, MIG ids). It never imports torch: a
parent that asks CUDA anything before it starts workers breaks them (vllm#15681). Each worker gets one
device by its position in the visible list (vLLM's way since vllm#45026: a per-rank CUDA_VISIBLE_DEVICES
hides the other GPUs from NCCL's peer-to-peer set-up, so it is set only when asked); the DP replicas of a
node get disjoint devices; CPUs are split among the workers of each NUMA node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Gpu",
    "Topology",
    "Visible",
    "Placement",
    "DeviceError",
    "visible_devices",
    "place",
    "parse_cpulist",
    "check_settings",
    "resolve_device",
    "DEVICES",
]


class DeviceError(ValueError):
    """A device setting that cannot hold on this node (what it asked, what the node has)."""


@dataclass(frozen=True)
class Gpu:
    index: int  # in PCI bus order (nvidia-smi's index; CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    uuid: str  # "GPU-8e5d..."
    pci: str  # "0000:3b:00.0"
    numa: int  # -1: unknown (one NUMA node, or the kernel does not say)


def parse_cpulist(text: str) -> list[int]:
    """A kernel cpulist ("0-3,8,10-11") as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


@dataclass
class Topology:
    """The GPUs the driver lists and the NUMA nodes' CPUs, read under `root` (a test gives a tree of its own)."""

    gpus: list[Gpu] = field(default_factory=list)
    numa_cpus: dict[int, list[int]] = field(default_factory=dict)
    root: str = "/"

    @classmethod
    def read(cls, root: str = "/") -> Topology:
        def text(*parts: str) -> str | None:
            try:
                with open(os.path.join(root, *parts)) as f:
                    return f.read()
            except OSError:
                return None

        found: list[tuple[str, str]] = []
        gpu_dir = os.path.join(root, "proc/driver/nvidia/gpus")
        for pci in sorted(os.listdir(gpu_dir)) if os.path.isdir(gpu_dir) else []:
            info = text("proc/driver/nvidia/gpus", pci, "information") or ""
            m = re.search(r"GPU UUID:\s*(\S+)", info)
            found.append((pci.lower(), m.group(1) if m else ""))
        gpus = []
        for i, (pci, uuid) in enumerate(found):
            numa = (text("sys/bus/pci/devices", pci, "numa_node") or "-1").strip()
            gpus.append(Gpu(i, uuid, pci, int(numa) if numa.lstrip("-").isdigit() else -1))
        numa_cpus: dict[int, list[int]] = {}
        node_dir = os.path.join(root, "sys/devices/system/node")
        for name in sorted(os.listdir(node_dir)) if os.path.isdir(node_dir) else []:
            m = re.fullmatch(r"node(\d+)", name)
            cpulist = text("sys/devices/system/node", name, "cpulist") if m else None
            if m and cpulist is not None:
                numa_cpus[int(m.group(1))] = parse_cpulist(cpulist)
        return cls(gpus, numa_cpus, root)

    def within(self, allowed: set[int]) -> Topology:
        """The same, with each NUMA node's CPUs cut to `allowed` (a process's affinity: a container's cpuset may
        hold only some of them), and nodes left with none dropped."""
        cut = {n: [c for c in cpus if c in allowed] for n, cpus in self.numa_cpus.items()}
        return Topology(self.gpus, {n: cpus for n, cpus in cut.items() if cpus}, self.root)


@dataclass(frozen=True)
class Visible:
    """One entry of the node's visible devices: `spec` as CUDA_VISIBLE_DEVICES (or the driver) names it."""

    spec: str
    gpu: Gpu | None  # None: a MIG instance by its own UUID, whose parent GPU the files do not name

    @property
    def numa(self) -> int:
        return -1 if self.gpu is None else self.gpu.numa


def _match(spec: str, topo: Topology, what: str) -> Visible:
    s = spec.strip()
    if re.fullmatch(r"\d+", s):
        i = int(s)
        if i >= len(topo.gpus):
            raise DeviceError(f"{what}: device {i} does not exist ({len(topo.gpus)} GPU(s) on this node)")
        return Visible(s, topo.gpus[i])
    m = re.fullmatch(r"MIG-(GPU-[0-9a-fA-F-]+)/\d+/\d+", s)  # the old MIG form names its parent GPU
    if s.startswith("GPU-") or m:
        prefix = (m.group(1) if m else s).lower()
        hits = [g for g in topo.gpus if g.uuid.lower().startswith(prefix)]
        if len(hits) != 1:
            why = "matches no GPU" if not hits else f"matches {len(hits)} GPUs"
            raise DeviceError(f"{what}: {s!r} {why} (this node has {', '.join(g.uuid for g in topo.gpus) or 'none'})")
        return Visible(s, hits[0])
    if s.startswith("MIG-"):
        return Visible(s, None)
    raise DeviceError(f"{what}: {s!r} is not a device index, a GPU-<uuid> or a MIG-<uuid>")


def visible_devices(topo: Topology, env: Mapping[str, str], device_ids: str | None = None) -> list[Visible]:
    """The devices this node's workers may use, in the order CUDA numbers them: CUDA_VISIBLE_DEVICES (unset:
    every GPU the driver lists), narrowed to `device_ids` (positions in that list, or UUIDs)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if not topo.gpus:  # no driver, no GPU: whatever CUDA_VISIBLE_DEVICES says, the workers run on the CPU
        if device_ids:
            raise DeviceError(f"device_ids={device_ids!r}: this node has no NVIDIA GPU (the driver lists none)")
        return []
    if cvd is None:
        seen = [Visible(str(g.index), g) for g in topo.gpus]
    else:
        seen = [_match(s, topo, f"CUDA_VISIBLE_DEVICES={cvd!r}") for s in cvd.split(",") if s.strip()]
    if not device_ids:
        return seen
    out: list[Visible] = []
    for s in (x.strip() for x in device_ids.split(",") if x.strip()):
        if s.isdigit():
            if int(s) >= len(seen):
                raise DeviceError(
                    f"device_ids={device_ids!r}: position {s} is past the {len(seen)} device(s) this node sees "
                    f"(CUDA_VISIBLE_DEVICES={cvd!r})"
                )
            pick = seen[int(s)]
        else:
            pick = next((v for v in seen if v.spec == s or (v.gpu and v.gpu.uuid.lower().startswith(s.lower()))), None)
            if pick is None:
                raise DeviceError(f"device_ids={device_ids!r}: {s!r} is not among this node's visible devices")
        if pick in out:
            raise DeviceError(f"device_ids={device_ids!r}: {s!r} is given twice")
        out.append(pick)
    return out


@dataclass(frozen=True)
class Placement:
    """One worker's place: its device (position in the node's visible list, None on a node without GPUs), the
    CPUs it is bound to (None: not bound) and the environment variables rayfree sets for it alone."""

    device: int | None
    cpus: tuple[int, ...] | None
    env: dict[str, str]
    numa: int = -1


def _numa_of(numa_bind: str, i: int, dev: Visible | None, topo: Topology) -> int:
    if numa_bind == "auto":
        return -1 if dev is None else dev.numa
    nodes = [int(x) for x in numa_bind.split(",")]
    return nodes[i % len(nodes)]


def place(
    topo: Topology,
    visible: list[Visible],
    n_workers: int,
    *,
    numa_bind: str = "none",
    per_rank_visible_devices: bool = False,
    gpu_nics: str | None = None,
    node: int = 0,
) -> list[Placement]:
    """Places for the `n_workers` workers of one node (every DP replica's, in order: replica k's workers follow
    replica k-1's), each on its own device when the node has GPUs."""
    if visible and n_workers > len(visible):
        raise DeviceError(
            f"node {node} runs {n_workers} worker(s) but sees {len(visible)} device(s) "
            f"({', '.join(v.spec for v in visible)}): give it more GPUs or fewer ranks per node"
        )
    nics = [x.strip() for x in gpu_nics.split(",")] if gpu_nics else []
    if nics and len(nics) < min(n_workers, len(visible) or n_workers):
        raise DeviceError(f"gpu_nics={gpu_nics!r} names {len(nics)} NIC(s) for {n_workers} worker(s)")
    numas = [
        _numa_of(numa_bind, i, visible[i] if visible else None, topo) if numa_bind != "none" else -1
        for i in range(n_workers)
    ]
    for n in set(numas) - {-1}:
        if n not in topo.numa_cpus:
            raise DeviceError(
                f"numa_bind={numa_bind!r}: NUMA node {n} does not exist on node {node}, or none of its CPUs is "
                f"this node's to use (its cpuset)"
            )
    out = []
    for i in range(n_workers):
        env: dict[str, str] = {}
        dev = visible[i] if visible else None
        device: int | None = i if dev is not None else None
        if dev is not None and per_rank_visible_devices:
            env["CUDA_VISIBLE_DEVICES"], device = dev.spec, 0
        if device is not None:
            env["RAYFREE_LOCAL_DEVICE"] = str(device)
        if nics:
            env["NCCL_IB_HCA"] = "=" + nics[i]  # "=": exactly this HCA, not every one whose name starts so
        cpus = None
        if numas[i] != -1:
            mates = [j for j in range(n_workers) if numas[j] == numas[i]]
            pool = topo.numa_cpus[numas[i]]
            k, n = mates.index(i), len(mates)
            share = pool[k * len(pool) // n : (k + 1) * len(pool) // n] or pool  # more workers than CPUs: share
            cpus = tuple(share)
        out.append(Placement(device, cpus, env, numas[i]))
    return out


#: where workers can run (ClusterConfig.device, RAYFREE_DEVICE, --device; a worker class's `runs_on`)
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(setting: str, n_visible: int, n_workers: int, node: int = 0) -> tuple[str, str]:
    """Where a node's `n_workers` workers run, "cpu" or "cuda", and a line saying why when `auto` chose the CPU
    on a node with GPUs ("" otherwise). `cuda` on a node with fewer devices than workers is refused (DeviceError,
    one line); `cpu` never places or counts GPUs."""
    if setting == "cpu":
        return "cpu", ""
    if setting == "cuda":
        if n_workers > n_visible:
            raise DeviceError(
                f"node {node} runs {n_workers} worker(s) but sees {n_visible} device(s) (device=cuda): give it "
                f"more GPUs or fewer ranks per node, or run them on the CPU with --device cpu"
            )
        return "cuda", ""
    if n_visible and n_workers <= n_visible:
        return "cuda", ""
    if not n_visible:
        return "cpu", ""
    return "cpu", (
        f"node {node} runs {n_workers} worker(s) but sees {n_visible} GPU(s): they run on the CPU (device=auto; "
        f"--device cuda refuses instead)"
    )


def check_settings(numa_bind: str, device_ids: str | None, gpu_nics: str | None, device: str = "auto") -> None:
    """The device settings' syntax, before anything reads the node's devices (DeviceError naming the field)."""
    if device not in DEVICES:
        raise DeviceError(f"device={device!r}: use auto, cpu or cuda")
    if numa_bind not in ("auto", "none") and not re.fullmatch(r"\d+(,\d+)*", numa_bind.replace(" ", "")):
        raise DeviceError(f"numa_bind={numa_bind!r}: use auto, none, or NUMA node ids by worker, e.g. 0,0,1,1")
    if device_ids is not None and not [x for x in device_ids.split(",") if x.strip()]:
        raise DeviceError(f"device_ids={device_ids!r}: name at least one device (positions or GPU UUIDs)")
    if gpu_nics is not None and not all(x.strip() for x in gpu_nics.split(",")):
        raise DeviceError(f"gpu_nics={gpu_nics!r}: one NIC name per device, comma-separated, none empty")
