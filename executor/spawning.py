"""How a worker process is started: the multiprocessing context, the environment it starts with, and its
re-import of the engine's main module (moved into the worker, under its lifeline)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

from rayfree import settings
from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.devices import DeviceError, Placement, Topology, Visible, place, visible_devices

__all__ = ["start_context", "worker_env", "main_in_worker", "node_topology", "node_places", "placements", "placed"]


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


def node_places(config: ClusterConfig, topo: Topology) -> tuple[list[Visible], list[Placement]]:
    """The node's visible devices and the places of all its workers, every DP replica's (replica k's after
    replica k-1's); DeviceError when they cannot hold."""
    par = config.parallel
    replicas = par.node_replicas if par.dp_rank in par.node_replicas else [par.dp_rank]
    visible = visible_devices(topo, os.environ, config.device_ids)
    every = place(
        topo,
        visible,
        len(replicas) * par.local_ranks,
        numa_bind=config.numa_bind,
        per_rank_visible_devices=config.per_rank_visible_devices,
        gpu_nics=config.gpu_nics,
        node=par.node_rank,
    )
    return visible, every


def placements(config: ClusterConfig) -> list[Placement]:
    """The places of this executor's workers: the node's places for every DP replica it runs (so replicas get
    disjoint devices), this replica's slice. Refused, before any worker starts, when the node runs more ranks
    than it has devices (ConfigError, one line naming both)."""
    par = config.parallel
    try:
        visible, every = node_places(config, node_topology())
    except DeviceError as e:
        raise ConfigError(f"{e} (refused before starting any worker)") from None
    replicas = par.node_replicas if par.dp_rank in par.node_replicas else [par.dp_rank]
    first = replicas.index(par.dp_rank) * par.local_ranks
    out = every[first : first + par.local_ranks]
    if visible and "CUDA_DEVICE_ORDER" not in os.environ:  # the driver's order, which device ids follow here
        out = [Placement(p.device, p.cpus, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **p.env}, p.numa) for p in out]
    return out


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
