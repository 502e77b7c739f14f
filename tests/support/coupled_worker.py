"""The toy model for coupled DP replicas' tests (importable by spawned workers)."""

from __future__ import annotations

from rayfree.cli.toy_engine import ToyWorker


class CoupledToyWorker(ToyWorker):
    """The toy model, recording each membership of coupled DP replicas its groups were formed for (the hook where
    an engine would redistribute its experts). Its groups are pairs, as a GPU worker's are with NCCL: gloo for the
    control plane and a second group of the device backend (gloo here) that the toy's all-reduce across replicas
    uses, so that the device half shrinks and grows too."""

    device_backend = "gloo"

    def on_replicas_changed(self, epoch: int, members: list[int]) -> None:
        self.__dict__.setdefault("_hooks", []).append([epoch, members])

    def hook_calls(self) -> list:
        return self.__dict__.get("_hooks", [])

    def device_halves(self) -> dict:
        """Whether the groups across replicas have a device half of their own (not the gloo group itself)."""
        from rayfree.cluster.parallel_state import get_dp_group, get_ep_group

        return {
            kind: g.device_group is not None and g.device_group is not g.cpu_group
            for kind, g in (("dp", get_dp_group()), ("ep", get_ep_group()))
        }
