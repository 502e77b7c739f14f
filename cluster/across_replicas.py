"""Coupled DP replicas (`replica_coupling="coupled"`): the DP and EP groups across the replicas that serve.

Each coupled replica forms a torch.distributed world of its own, as an
independent one does, so a lost replica fails alone and rejoins. The groups
that cross replicas are process groups of their own, made at each membership
epoch on the rendezvous store under that epoch's name: they rest on no world,
so losing a replica leaves nothing broken behind that a survivor must use
again, and a rejoined replica joins them without re-forming anyone's world.
Epoch 0 spans every replica (the first incarnations start together); node 0
declares every later one (executor/membership.py), and every member's ranks form
it side by side (`regroup`). A rank whose collective found a peer gone drops
its groups (`drop`): that closes their sockets, so a survivor still waiting in
that collective for it errs at once instead of at the groups' timeout.

The groups' process groups are known to torch.distributed with this rank's
own place only (their other ranks are not the world's): use them for
collectives that name no rank (all_reduce, all_gather, all_to_all). Each is a
pair like the world's groups: `cpu_group` (gloo) and `device_group`, of the
world's device backend (NCCL on GPUs: made the same way, on the same store,
under a name of its own), or the gloo group itself when the world has none.
"""

from __future__ import annotations

import datetime
import logging

from torch.distributed.distributed_c10d import PrefixStore

from rayfree import settings

from . import parallel_state as ps
from .config import ParallelConfig
from .group import GroupError

__all__ = ["regroup", "drop"]

logger = logging.getLogger("rayfree.cluster")

#: the membership epoch and members the current groups were formed for (None: none formed)
_AT: tuple[int, list[int]] | None = None
#: what a GroupLeft from a replaced group tells the engine
_FETCH = "call get_dp_group() / get_ep_group() where a step uses them, not once (their members change)"


def _ranks(par: ParallelConfig, rank: int, members: list[int]) -> dict[str, list[int]]:
    """The DP and EP groups of local rank `rank` over the member replicas, as global ranks ([DP][PP][PCP][TP])."""
    ws, inner = par.world_size, par.prefill_context_parallel_size * par.tensor_parallel_size
    stage = rank // inner
    return {
        "dp": [d * ws + rank for d in members],
        "ep": [d * ws + stage * inner + j for d in members for j in range(inner)],
    }


def regroup(par: ParallelConfig, rank: int, at: int, members: list[int], wait_s: float | None = None) -> None:
    """Form this rank's DP and EP groups over replicas `members` in membership epoch `at` (every member's ranks
    call it with the same epoch and members). Their ranks first meet on the store, for up to `wait_s` (default
    RAYFREE_ACROSS_REPLICAS_TIMEOUT_S: the replicas' first groups wait as long as their join); each collective on the
    groups then waits RAYFREE_ACROSS_REPLICAS_TIMEOUT_S at most for a member (one stopped, or cut off, under it)."""
    global _AT
    me = par.global_rank(rank)
    if par.dp_rank not in members:
        raise GroupError(f"rank {me}: its DP replica {par.dp_rank} is not among the members {members}")
    store = ps._STORE
    if store is None:
        raise GroupError("the groups across replicas need the world's rendezvous: call init_distributed_environment()")
    while isinstance(store, PrefixStore):  # (a replica that rejoined met under its own name: the same store)
        store = store.underlying_store
    bound = float(settings.get("RAYFREE_ACROSS_REPLICAS_TIMEOUT_S"))
    timeout = datetime.timedelta(seconds=bound)
    drop()
    for kind, ranks in _ranks(par, rank, members).items():
        name, index = f"rayfree/across/e{at}/{kind}/{ranks[0]}/", ranks.index(me)
        if len(ranks) == 1:  # (a group of one is a real group of one: group=None would be torch's whole world)
            pg, dev = ps.solo_pair(name.rstrip("/"))
        else:
            group = PrefixStore(name, store)
            _meet(group, len(ranks), wait_s or bound, f"rank {me}: the {kind} group across replicas {members}")
            pg = dev = ps.make_process_group("gloo", group, index, len(ranks), timeout, name)
            ps.known(pg, group, "gloo", name, index)
            if ps._DEVICE_BACKEND is not None:  # (the device half: its own connections, under its own name)
                half = PrefixStore("device/", group)
                dev = ps.make_process_group(ps._DEVICE_BACKEND, half, index, len(ranks), timeout, name + "device")
                ps.known(dev, half, ps._DEVICE_BACKEND, name + "device", index)
        old = ps._GROUPS.pop(kind, None)  # (the replica world's own group of the kind, before the first regroup)
        if old is not None:
            ps.release(old, f"rank {me}: this {kind} group was replaced at membership epoch {at}: {_FETCH}")
        ps._GROUPS[kind] = ps._make_group(kind, ranks, pg, rank=me)  # (global ranks, not the replica world's)
        ps._GROUPS[kind].device_group = dev
    _AT = (at, list(members))
    logger.info("rank %d: groups across DP replicas %s formed (membership epoch %d)", me, members, at)


def _meet(store: PrefixStore, size: int, wait_s: float, what: str) -> None:
    """Until all `size` ranks of a group have come (bounded): the last to come says so."""
    if store.add("came", 1) == size:
        store.set("all", b"1")
    try:
        store.wait(["all"], datetime.timedelta(seconds=wait_s))
    except Exception as e:  # noqa: BLE001 - torch's store says only "timeout"
        raise GroupError(f"{what}: not every member came within {wait_s:.0f}s ({e})") from e


def drop() -> None:
    """Release this rank's groups across replicas (their sockets close: peers waiting on them err at once).
    They stay the groups `get_dp_group()` gives, left: a use raises GroupLeft, read as a lost peer, so a rank
    whose collective failed while its replica's others' passed stays too at the next step's use, until the new
    membership's groups replace them (executor/membership.py)."""
    global _AT
    if _AT is None:
        return
    at, members = _AT
    for kind in ("dp", "ep"):
        g = ps._GROUPS.get(kind)
        if g is not None:
            ps.release(
                g,
                f"this rank left the {kind} group across replicas {members} (membership epoch {at}) when a "
                f"peer of it went away; it forms again over the replicas that serve before the next call",
            )
    _AT = None
