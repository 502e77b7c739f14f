"""A node's GPUs and NUMA nodes as files, in a tree of the test's own: what the driver (/proc/driver/nvidia) and
the kernel (/sys) show on a GPU node, read by the same placement code that reads a real node's."""

from __future__ import annotations

from pathlib import Path


def uuid_of(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-44445555{i:04x}"


def fake_topology(root: Path, numa_of_gpu: list[int], cpus_of_numa: dict[int, str]) -> Path:
    """GPU i on PCI bus 0000:{10+i:02x}:00.0, on NUMA node numa_of_gpu[i]; NUMA node n with cpulist
    cpus_of_numa[n]."""
    for i, numa in enumerate(numa_of_gpu):
        pci = f"0000:{0x10 + i:02x}:00.0"
        info = root / "proc/driver/nvidia/gpus" / pci
        info.mkdir(parents=True)
        (info / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t {100 + i}\nGPU UUID: \t {uuid_of(i)}\n"
            f"Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"Bus Location: \t {pci}\nDevice Minor: \t {i}\n"
        )
        dev = root / "sys/bus/pci/devices" / pci
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{numa}\n")
    for n, cpulist in cpus_of_numa.items():
        node = root / "sys/devices/system/node" / f"node{n}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpulist + "\n")
    return root


def main(argv: list[str]) -> int:
    """`python -m tests.support.topology N DIR`: a node with N GPUs (all on NUMA node 0, with every CPU this
    process may use), for RAYFREE_TOPOLOGY_ROOT: CI runs the suite's representative paths on 1 and 8."""
    import os

    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -m tests.support.topology N_GPUS DIR", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    fake_topology(Path(argv[1]), [0] * int(argv[0]), {0: ",".join(map(str, cpus))})
    print(argv[1])
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
