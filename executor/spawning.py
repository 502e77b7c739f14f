"""How a worker process is started: the multiprocessing context, the environment it starts with, and its
re-import of the engine's main module (moved into the worker, under its lifeline)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from rayfree import settings
from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.devices import (
    DeviceError,
    Placement,
    Topology,
    Visible,
    place,
    resolve_device,
    visible_devices,
)

__all__ = [
    "start_context", "worker_env", "main_in_worker", "node_topology", "node_places", "NodePlaces", "placements",
    "placed",
]  # fmt: skip

logger = logging.getLogger("rayfree.executor")


def start_context() -> Any:
    """The multiprocessing context workers start with (RAYFREE_WORKER_MULTIPROC_METHOD, default spawn)."""
    method = settings.get("RAYFREE_WORKER_MULTIPROC_METHOD")
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"RAYFREE_WORKER_MULTIPROC_METHOD={method!r}: use spawn, fork or forkserver")
    return multiprocessing.get_context(method)


@contextlib.contextmanager
def main_in_worker(kwargs: dict[str, Any]) -> Iterator[None]:
    """While one worker is spawned: its re-import of the engine's main module (spawn's preparation step, which
    runs the script's module-level imports, torch's included) is moved into `worker_main`, after its signal
    handlers and lifeline are in place, so an engine that dies meanwhile is noticed (and nothing of it left
    behind). multiprocessing asks `get_preparation_data` just before it pickles the process object, so the
    main module's name or path goes into this worker's own arguments instead (`kwargs` is the process
    object's own dict: `Process` keeps a copy of what it was given)."""
    import multiprocessing.spawn as spawn

    real = spawn.get_preparation_data

    def prepare(name: str) -> dict[str, Any]:
        data = real(name)
        for key in ("init_main_from_name", "init_main_from_path"):
            if key in data:
                kwargs["main_module"] = (key, data.pop(key))
        return data

    spawn.get_preparation_data = prepare  # type: ignore[assignment]
    try:
        yield
    finally:
        spawn.get_preparation_data = real  # type: ignore[assignment]


@contextlib.contextmanager
def worker_env() -> Iterator[None]:
    """While workers start: one OpenMP thread each unless OMP_NUM_THREADS is set (N workers x all cores
    of threads only fight each other). The parent's own environment is restored afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if saved is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def node_topology() -> Topology:
    """This node's GPUs and NUMA nodes, with the CPUs this process may use (its cpuset)."""
    return Topology.read(settings.get("RAYFREE_TOPOLOGY_ROOT")).within(os.sched_getaffinity(0))


class NodePlaces(NamedTuple):
    """A node's visible devices, the places of all its workers, where they run ("cpu", "cuda") and, when
    device=auto chose the CPU on a node with GPUs, the line that says so."""

    visible: list[Visible]
    places: list[Placement]
    device: str
    note: str


def node_places(config: ClusterConfig, topo: Topology) -> NodePlaces:
    """The node's visible devices and the places of all its workers, every DP replica's (replica k's after
    replica k-1's), on the device `config.device` resolves to; DeviceError when they cannot hold."""
    par = config.parallel
    replicas = par.node_replicas if par.dp_rank in par.node_replicas else [par.dp_rank]
    n = len(replicas) * par.local_ranks
    visible = visible_devices(topo, os.environ, config.device_ids) if config.device != "cpu" else []
    device, note = resolve_device(config.device, len(visible), n, par.node_rank)
    every = place(
        topo,
        visible if device == "cuda" else [],
        n,
        numa_bind=config.numa_bind,
        per_rank_visible_devices=config.per_rank_visible_devices,
        gpu_nics=config.gpu_nics if device == "cuda" else None,
        node=par.node_rank,
    )
    return NodePlaces(visible, every, device, note)


def placements(config: ClusterConfig) -> tuple[list[Placement], str]:
    """The places of this executor's workers (the node's places for every DP replica it runs, so replicas get
    disjoint devices: this replica's slice) and where they run ("cpu", "cuda"). Refused, before any worker
    starts, when the node runs more ranks than it has devices and device=cuda (ConfigError, one line naming
    both); device=auto on a node with too few GPUs runs them on the CPU and says so."""
    par = config.parallel
    try:
        node = node_places(config, node_topology())
    except DeviceError as e:
        raise ConfigError(f"{e} (refused before starting any worker)") from None
    if node.note and par.dp_rank == (par.node_replicas or [par.dp_rank])[0]:  # (once a node)
        logger.warning("%s", node.note)
    replicas = par.node_replicas if par.dp_rank in par.node_replicas else [par.dp_rank]
    first = replicas.index(par.dp_rank) * par.local_ranks
    out = node.places[first : first + par.local_ranks]
    if node.device == "cuda" and "CUDA_DEVICE_ORDER" not in os.environ:  # the driver's order, which ids follow
        out = [Placement(p.device, p.cpus, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **p.env}, p.numa) for p in out]
    return out, node.device


@contextlib.contextmanager
def placed(p: Placement) -> Iterator[None]:
    """While one worker starts: its own variables in the environment, and this thread bound to its CPUs, which
    a spawned or forked child inherits from its first instruction on (before it imports torch or allocates:
    Linux then allocates its memory on the NUMA node it runs on). Both are restored afterwards; the worker
    applies them again itself (worker_main), for a forkserver's children."""
    saved_env = {k: os.environ.get(k) for k in p.env}
    saved_cpus = os.sched_getaffinity(0) if p.cpus is not None else None
    os.environ.update(p.env)
    try:
        if p.cpus is not None:
            os.sched_setaffinity(0, p.cpus)  # (0: this thread alone, on Linux)
        yield
    finally:
        if saved_cpus is not None:
            os.sched_setaffinity(0, saved_cpus)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
