"""The process-wide parallel groups: world, TP, PP, DP, PCP, DCP, EP and the inner-DP world.

Names follow vLLM so engine code ports over. Ranks are laid out
[DP][PP][PCP][TP] (see config.py). Every rank must call the same functions in
the same order: each group creation is a collective over the whole world.

Joining is checked by rayfree itself before torch.distributed (join.py): a
rank that never arrives is named, and nodes that disagree on the shape are
told so.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import PrefixStore

from rayfree.transport import get_ip

from .config import ParallelConfig
from .group import Group, GroupError
from .join import JoinError, join

__all__ = [
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "get_world_group",
    "get_tp_group",
    "get_pp_group",
    "get_dp_group",
    "get_pcp_group",
    "get_dcp_group",
    "get_ep_group",
    "get_inner_dp_world_group",
    "destroy_model_parallel",
    "destroy_distributed_environment",
    "adopt_distributed_environment",
    "JoinError",
]

logger = logging.getLogger("rayfree.cluster")


_WORLD: Group | None = None
_GROUPS: dict[str, Group] = {}
_STORE = None
#: the world was joined by the engine itself (adopt_distributed_environment): leaving it is the engine's job
_ADOPTED = False
_TIMEOUT_S = 120.0
_FORCE_REMOTE: bool | None = None
_MASTER = "127.0.0.1"
#: the backend of the groups' device halves (None: they are the gloo groups)
_DEVICE_BACKEND: str | None = None
#: the process groups made outside torch's world and registered by `known` (one-rank groups, the groups across
#: replicas), released by `release`
_OWN: list[Any] = []
#: the gloo device those groups share, the world's (each device runs a thread that wakes every 10 ms)
_GLOO_DEVICE: Any = None


def _parse_init_method(method: str) -> tuple[str, int]:
    u = urlparse(method)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise GroupError(f"distributed_init_method={method!r}: use tcp://<master_addr>:<master_port>")
    return u.hostname, u.port


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    local_rank: int = -1,
    backend: str = "gloo",
    *,
    timeout_s: float = 120.0,
    force_remote: bool | None = None,
    shape: str = "",
    node: int = -1,
    device_backend: str | None = None,
    rendezvous: tuple[int, int, str, bool, bool] | None = None,
) -> Group:
    """Join the world (torch.distributed, gloo on CPU) and return the world group.

    `shape` (join.shape_of) and `node` let a rank that finds others with another shape say so. With
    `device_backend` ("nccl" on GPUs) every group is a pair, as vLLM's GroupCoordinator: `cpu_group` (gloo,
    the control plane's bytes) and `device_group` (that backend, the tensors on the device); without, the
    device group is the gloo group itself. `rendezvous` (size, rank, name, alone, hosts): the rendezvous is not
    this world's alone: independent DP replicas meet there (the first rank of all hosts it) and each forms a
    world of its own under its name in the store; `alone`: a replica that rejoins meets under its name, its ranks
    only, at the store the first incarnations' rank 0 still hosts, or (`hosts`) this rank hosts it: node 0's
    first rank, node 0 started again.
    """
    global _WORLD, _STORE, _TIMEOUT_S, _FORCE_REMOTE, _MASTER, _DEVICE_BACKEND
    if _WORLD is not None:
        if _WORLD.world_size != world_size or _WORLD.rank != rank:
            raise GroupError(f"already initialized as rank {_WORLD.rank} of {_WORLD.world_size}")
        return _WORLD
    if not 0 <= rank < world_size:
        raise GroupError(f"rank {rank} is out of range for world_size {world_size}")
    host, port = _parse_init_method(distributed_init_method)
    size, at, name, alone, hosts = rendezvous or (world_size, rank, "", False, False)
    prefix = f"rayfree/rejoin/{name}/" if alone else ""
    store = join(host, port, size, at, timeout_s, shape, node, prefix=prefix, serve_store=hosts)
    dist.init_process_group(
        backend,
        store=PrefixStore(f"rayfree/world/{name}", store) if name else store,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _STORE, _TIMEOUT_S, _FORCE_REMOTE, _MASTER = store, timeout_s, force_remote, host
    _WORLD = _make_group("world", list(range(world_size)), dist.group.WORLD)
    _DEVICE_BACKEND = device_backend
    if device_backend is not None:
        _WORLD.device_group = _new_group(list(range(world_size)), device_backend)
    return _WORLD


def _new_group(ranks: list[int], backend: str) -> Any:
    return dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=_TIMEOUT_S))


def adopt_distributed_environment(
    parallel: ParallelConfig, *, timeout_s: float = 120.0, force_remote: bool | None = None
) -> Group:
    """Build rayfree's groups on a torch.distributed world the engine joined itself (vLLM's workers do).

    Rayfree's groups exchange bytes over gloo, so on a world whose default backend is another (NCCL)
    they get gloo groups of their own. A collective: every rank of the world calls it. Returns the
    world group; the world stays the engine's (destroy_distributed_environment leaves it).
    """
    global _WORLD, _TIMEOUT_S, _FORCE_REMOTE, _MASTER, _ADOPTED
    if not dist.is_initialized():
        raise GroupError(
            "adopt_distributed_environment: torch.distributed is not initialized; call "
            "init_distributed_environment() instead"
        )
    if _WORLD is not None:
        return _WORLD
    n = dist.get_world_size()
    if n != parallel.world_size_across_dp:
        raise GroupError(
            f"the engine's world has {n} ranks but the configuration has "
            f"{parallel.world_size_across_dp}: give rayfree the engine's parallel sizes"
        )
    _TIMEOUT_S, _FORCE_REMOTE, _MASTER, _ADOPTED = timeout_s, force_remote, parallel.master_addr, True
    pg = (
        dist.group.WORLD
        if dist.get_backend() == "gloo"
        else dist.new_group(list(range(n)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    )
    _WORLD = _make_group("world", list(range(n)), pg)
    initialize_model_parallel(parallel)
    return _WORLD


def _make_group(name: str, ranks: list[int], pg: Any, rank: int | None = None) -> Group:
    # Publishers bind to the address that routes toward the master: the cluster network. `rank`: this rank's
    # place in `ranks` when those are not the world's (the groups across coupled replicas: global ranks).
    return Group(
        ranks,
        dist.get_rank() if rank is None else rank,
        pg,
        name=name,
        advertise_ip=get_ip(peer=_MASTER),
        force_remote=_FORCE_REMOTE,
        queue_timeout_s=_TIMEOUT_S,
    )


def _layout(parallel: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Group membership for every group kind, from the [DP][PP][PCP][TP] layout."""
    tp, pp, pcp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.prefill_context_parallel_size
    inner = tp * pp * pcp
    if world_size % inner:
        raise GroupError(
            f"world size {world_size} is not a multiple of tensor x pipeline x prefill-context parallel = {inner}"
        )
    dp = world_size // inner
    if dp not in (1, parallel.data_parallel_size):
        raise GroupError(
            f"world size {world_size} holds {dp} replicas of {inner} ranks, but "
            f"data_parallel_size={parallel.data_parallel_size}"
        )
    r = torch.arange(world_size).reshape(dp, pp, pcp, tp)
    dcp = parallel.decode_context_parallel_size

    def rows(t: torch.Tensor, n: int) -> list[list[int]]:
        return [row.tolist() for row in t.reshape(-1, n)]

    return {
        "tp": rows(r, tp),
        "dcp": rows(r, dcp),
        "pcp": rows(r.transpose(2, 3), pcp),
        "pp": rows(r.transpose(1, 3), pp),
        "dp": rows(r.transpose(0, 3), dp),
        "ep": rows(r.transpose(0, 1), dp * pcp * tp),
        "inner_dp_world": rows(r, inner),
    }


def initialize_model_parallel(parallel_config: ParallelConfig) -> None:
    """Create every parallel group; a collective: all ranks call it with the same config."""
    world = get_world_group()
    if _GROUPS:
        raise GroupError("model parallel groups already exist: call destroy_model_parallel() first")
    layout = _layout(parallel_config, world.world_size)
    for kind, groups in layout.items():
        for ranks in groups:
            # new_group is collective: every rank creates every group and keeps its own. Whole-world ones reuse
            # the world's; a one-rank group is a real group of one, made by its rank alone (group=None would be
            # read by torch as the default group: the whole world).
            if len(ranks) == world.world_size:
                pg, dev = world.cpu_group, world.device_group
            elif len(ranks) == 1:
                pg = dev = None
                if world.rank in ranks:
                    pg, dev = solo_pair(f"rayfree/solo/{kind}/{ranks[0]}")
            else:
                pg = _new_group(ranks, "gloo")
                dev = _new_group(ranks, _DEVICE_BACKEND) if _DEVICE_BACKEND else pg
            if world.rank in ranks:
                _GROUPS[kind] = _make_group(kind, ranks, pg)
                _GROUPS[kind].device_group = dev


def make_process_group(
    backend: str, store: Any, index: int, size: int, timeout: datetime.timedelta, name: str = ""
) -> Any:
    """A process group of `backend` over `size` ranks meeting on `store` (this rank at `index`), outside
    torch's world bookkeeping (`known` registers it). Its backend sits in a `ProcessGroup`, as torch's own
    groups' do: torch (inductor's compile, vLLM's CPU path) walks every group it knows as one."""
    kind = dist.ProcessGroup.BackendType
    devices: tuple[str, ...]
    if backend == "gloo":
        options = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 - (not in torch's stubs)
        options._timeout, options._devices = timeout, [_gloo_device()]
        impl: Any = dist.ProcessGroupGloo(store, index, size, options)
        devices, which = ("cpu", "cuda"), kind.GLOO
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl, devices, which = dist.ProcessGroupNCCL(store, index, size, options), ("cuda",), kind.NCCL
    else:
        raise GroupError(f"device_backend={backend!r}: groups made outside the world are gloo or nccl")
    pg: Any = dist.ProcessGroup(store, index, size)
    pg._set_default_backend(which)
    for device in devices:
        pg._register_backend(torch.device(device), which, impl)
    pg._set_group_name(name or f"rayfree/{id(pg)}")
    pg._set_group_desc(name or "rayfree")
    return pg


def _gloo_device() -> Any:
    """The world's gloo device (its network interface), else one of this process's own, for every group made
    here: a device per group would be a loop thread per group, each waking 100 times a second while idle."""
    global _GLOO_DEVICE
    if _GLOO_DEVICE is None:
        try:
            pg = dist.group.WORLD if dist.is_initialized() else None
            world = pg._get_backend(torch.device("cpu")) if pg is not None else None
        except (RuntimeError, AttributeError):  # (no gloo backend in the world)
            world = None
        found = getattr(getattr(world, "options", None), "_devices", None)
        _GLOO_DEVICE = found[0] if found else dist.ProcessGroupGloo.create_default_device()
    return _GLOO_DEVICE


def known(pg: Any, store: Any, backend: str, name: str, index: int) -> None:
    """Tell torch.distributed of a process group made by `make_process_group` (this rank's place in it only), so
    that its collectives (and their error logging, which looks the group up) take it like any group; `release`
    lets it go."""
    w: Any = distributed_c10d._world
    w.pg_map[pg], w.pg_names[pg], w.pg_backend_config[pg] = (backend, store), name, backend
    w.pg_group_ranks[pg] = {dist.get_rank(): index}
    _OWN.append(pg)


def forget(pg: Any) -> None:
    """Release a process group that `known` registered: its sockets close now (NCCL's communicator is aborted,
    as its graceful end would wait for a peer that may be gone)."""
    w = distributed_c10d._world
    backend = w.pg_backend_config.get(pg)
    for table in (w.pg_map, w.pg_names, w.pg_backend_config, w.pg_group_ranks):
        table.pop(pg, None)
    try:
        pg.abort() if backend == "nccl" else pg.shutdown()
    except Exception as e:  # noqa: BLE001 - it goes with its last reference anyway
        logger.debug("shutting a process group down: %s", e)


def solo_pair(name: str) -> tuple[Any, Any]:
    """A group of this rank alone, as a pair (gloo, and the device backend's when the world has one): collectives
    on it are this rank's own values, as on vLLM's GroupCoordinator of one rank."""
    store = PrefixStore(name + "/", getattr(dist, "HashStore")())  # noqa: B009 - (not in torch's stubs' exports)
    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    pg = dev = make_process_group("gloo", store, 0, 1, timeout, name)
    known(pg, store, "gloo", name, 0)
    if _DEVICE_BACKEND is not None:  # (a pair like every other group's: the device half its own group)
        half = PrefixStore("device/", store)
        dev = make_process_group(_DEVICE_BACKEND, half, 0, 1, timeout, name + "/device")
        known(dev, half, _DEVICE_BACKEND, name + "/device", 0)
    return pg, dev


def release(g: Group, why: str) -> None:
    """Release the halves of `g` that were made outside torch's world (one-rank groups, the groups across
    replicas): `forget`, not destroy_process_group, which knows nothing of them. A handle to `g` that someone
    kept raises GroupLeft(`why`) from then on."""
    halves = g.halves()
    own = [pg for pg in _OWN if any(pg is h for h in halves)]
    _OWN[:] = [pg for pg in _OWN if all(pg is not o for o in own)]
    for pg in own:
        forget(pg)
    if own:
        g.cpu_group = g.device_group = None
    g.leave(why)


def model_parallel_is_initialized() -> bool:
    return bool(_GROUPS)


def _get(kind: str, what: str) -> Group:
    g = _GROUPS.get(kind)
    if g is None:
        raise GroupError(
            f"the {what} group is not initialized: call init_distributed_environment() and then "
            f"initialize_model_parallel(parallel_config) first (coupled DP replicas: or a replica was lost, and the "
            f"groups across replicas are formed again before the next call)"
        )
    return g


def get_world_group() -> Group:
    if _WORLD is None:
        raise GroupError("the world group is not initialized: call init_distributed_environment() first")
    return _WORLD


def get_tp_group() -> Group:
    return _get("tp", "tensor-parallel")


def get_pp_group() -> Group:
    return _get("pp", "pipeline-parallel")


def get_dp_group() -> Group:
    return _get("dp", "data-parallel")


def get_pcp_group() -> Group:
    return _get("pcp", "prefill-context-parallel")


def get_dcp_group() -> Group:
    return _get("dcp", "decode-context-parallel")


def get_ep_group() -> Group:
    return _get("ep", "expert-parallel")


def get_inner_dp_world_group() -> Group:
    return _get("inner_dp_world", "inner-DP world")


def destroy_model_parallel() -> None:
    """Close every queue the parallel groups built and release their process groups."""
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    for g in groups:
        release(g, f"the {g.name} group was destroyed (destroy_model_parallel)")
        g.destroy()


def destroy_distributed_environment() -> None:
    """Leave torch.distributed (after destroy_model_parallel) and drop the world group."""
    global _WORLD, _STORE, _ADOPTED, _DEVICE_BACKEND, _GLOO_DEVICE
    destroy_model_parallel()
    _DEVICE_BACKEND = _GLOO_DEVICE = None
    if _WORLD is not None:
        _WORLD.destroy()
        _WORLD = None
    if dist.is_initialized() and not _ADOPTED:
        dist.destroy_process_group()
    _STORE, _ADOPTED = None, False
