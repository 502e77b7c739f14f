"""The toy model for coupled DP replicas' tests (importable by spawned workers)."""

from __future__ import annotations

from rayfree.cli.toy_engine import ToyWorker


class CoupledToyWorker(ToyWorker):
    """The toy model, recording each membership of coupled DP replicas its groups were formed for (the hook where
    an engine would redistribute its experts). Its groups are pairs, as a GPU worker's are with NCCL: gloo for the
    control plane and a second group of the device backend (gloo here) that the toy's all-reduce across replicas
    uses, so that the device half shrinks and grows too."""

    device_backend = "gloo"

    def execute_model(self, scheduler_output):
        if self.__dict__.get("_check", True):  # the first step, and the first after each membership: every member's
            self._check = False  # ranks come here together, on groups just formed
            self.__dict__.setdefault("_checks", []).append(group_check(self))
        return super().execute_model(scheduler_output)

    def on_replicas_changed(self, epoch: int, members: list[int]) -> None:
        self.__dict__.setdefault("_hooks", []).append([epoch, members])
        self._check = True

    def group_checks(self) -> list:
        """Each check's wrong sums ([kind, half, got, want]) and the DP group's members it ran over."""
        return self.__dict__.get("_checks", [])

    def hook_calls(self) -> list:
        return self.__dict__.get("_hooks", [])

    def device_halves(self) -> dict:
        """Whether the groups across replicas have a device half of their own (not the gloo group itself)."""
        from rayfree.cluster.parallel_state import get_dp_group, get_ep_group

        return {
            kind: g.device_group is not None and g.device_group is not g.cpu_group
            for kind, g in (("dp", get_dp_group()), ("ep", get_ep_group()))
        }


KINDS = ("world", "tp", "pp", "dp", "pcp", "dcp", "ep", "inner_dp_world")


def group_check(worker) -> dict:
    """Every group the docs show, both halves, as the docs use them (`dist.all_reduce(t, group=g.device_group)`):
    each rank adds 2**(its global rank), and the sum must be that of the group's own ranks. A group of one sums
    its own rank's value alone (group=None would have been the replica's whole world)."""
    import torch
    import torch.distributed as dist

    from rayfree.cluster import across_replicas
    from rayfree.cluster import parallel_state as ps

    par = worker.parallel_config
    base = par.dp_rank * par.world_size  # (the replica's own world numbers its ranks from 0)
    across = across_replicas._AT is not None
    wrong = []
    for kind in KINDS:
        g = ps.get_world_group() if kind == "world" else ps._GROUPS[kind]
        globals_ = g.ranks if across and kind in ("dp", "ep") else [base + r for r in g.ranks]
        want = float(sum(2**r for r in globals_))
        for half in ("cpu_group", "device_group"):
            t = torch.tensor([float(2 ** par.global_rank(worker.rank))], dtype=torch.float64)
            dist.all_reduce(t, group=getattr(g, half))
            if t.item() != want:
                wrong.append([kind, half, t.item(), want])
    from torch.distributed import distributed_c10d

    # every group torch knows is a ProcessGroup, as its own walks (inductor's, under vLLM) take them
    wrong += [["not a ProcessGroup", type(pg).__name__] for pg in distributed_c10d._world.pg_map
              if not hasattr(pg, "_device_types")]  # fmt: skip
    return {"dp": ps.get_dp_group().ranks, "wrong": wrong}
