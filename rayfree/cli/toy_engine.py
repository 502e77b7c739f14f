"""A toy engine: an MLP split over tensor-parallel ranks and pipeline stages, on CPU with gloo.

Block l computes x + relu(x W1_l^T) W2_l^T. Tensor parallelism splits the
hidden dimension: each TP rank holds a slice of W1's rows and W2's columns,
computes a partial W2 product, and the partials are all-reduced over the TP
group. Pipeline parallelism gives each stage a contiguous run of blocks;
activations go from stage to stage with gloo send/recv.

Weights are small integers and activations float64, so every partial sum is
exact and the distributed result equals `reference_forward` bit for bit.

With data parallelism each replica runs its own batches (`make_batch(step,
replica=r)`), and every step all-reduces the sum of each replica's input over
the DP group, across replicas (`step_report()["dp_sum"]`), as an MoE model's
expert-parallel all-to-all would: a replica without its cross-replica group,
or one that is not stepping, fails it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rayfree.worker.base import WorkerBase

__all__ = ["ToyWorker", "make_weights", "reference_forward", "make_batch", "dp_sum"]

D_MODEL, D_HIDDEN, N_LAYERS, SEED = 8, 16, 4, 1234


def make_weights(n_layers: int = N_LAYERS, d: int = D_MODEL, h: int = D_HIDDEN, seed: int = SEED):
    """[(W1 (h, d), W2 (d, h))] per layer, entries in {-1, 0, 1}."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(-1, 2, (h, d), generator=g).double(), torch.randint(-1, 2, (d, h), generator=g).double())
        for _ in range(n_layers)
    ]


def make_batch(step: int, batch: int = 4, d: int = D_MODEL, replica: int = 0) -> dict[str, Any]:
    """A batch of integer-valued activations, different every step and every DP replica."""
    g = torch.Generator().manual_seed(step + replica * 1_000_003)
    return {"step": step, "x": torch.randint(-3, 4, (batch, d), generator=g).double()}


def dp_sum(step: int, replicas: int) -> float:
    """What every replica's step `step` all-reduces: the sum of all replicas' inputs."""
    return float(sum(make_batch(step, replica=r)["x"].sum() for r in range(replicas)))


def reference_forward(x: torch.Tensor, weights=None) -> torch.Tensor:
    """The whole model in one process."""
    for w1, w2 in weights or make_weights():
        x = x + torch.relu(x @ w1.T) @ w2.T
    return x


class ToyWorker(WorkerBase):
    """Worker kwargs: n_layers, d_model, d_hidden, seed (defaults above)."""

    def load_model(self) -> None:
        from rayfree.cluster.parallel_state import get_pp_group, get_tp_group

        self.tp, self.pp = get_tp_group(), get_pp_group()
        n_layers = self.kwargs.get("n_layers", N_LAYERS)
        d, h = self.kwargs.get("d_model", D_MODEL), self.kwargs.get("d_hidden", D_HIDDEN)
        if h % self.tp.world_size or n_layers % self.pp.world_size:
            raise ValueError(
                f"d_hidden={h} must divide by TP={self.tp.world_size} and n_layers={n_layers} by "
                f"PP={self.pp.world_size}"
            )
        weights = make_weights(n_layers, d, h, self.kwargs.get("seed", SEED))
        per_stage = n_layers // self.pp.world_size
        mine = weights[self.pp.rank_in_group * per_stage : (self.pp.rank_in_group + 1) * per_stage]
        cols = h // self.tp.world_size
        lo = self.tp.rank_in_group * cols
        self.dev = self.device if self.device is not None else torch.device("cpu")  # cuda:{device_index} on GPUs
        self.layers = [
            (w1[lo : lo + cols].contiguous().to(self.dev), w2[:, lo : lo + cols].contiguous().to(self.dev))
            for w1, w2 in mine
        ]
        self.last_step_s = 0.0
        self.last_dp_sum = 0.0

    def execute_model(self, scheduler_output: dict[str, Any]) -> torch.Tensor | None:
        import torch.distributed as dist

        from rayfree.cluster.parallel_state import get_dp_group

        t0 = time.perf_counter()
        pp, dp = self.pp, get_dp_group()  # (coupled DP replicas: formed again when one is lost or rejoins)
        x = scheduler_output["x"]
        par = self.parallel_config
        total = x.sum().reshape(1).to(self.dev)
        x = x.to(self.dev)  # tensors on the device go over the device groups (the gloo groups themselves on CPU)
        if pp.rank_in_group > 0:
            x = torch.empty_like(x)
            dist.recv(x, src=pp.ranks[pp.rank_in_group - 1], group=pp.device_group)
        for w1, w2 in self.layers:
            partial = torch.relu(x @ w1.T) @ w2.T
            if self.tp.world_size > 1:
                dist.all_reduce(partial, group=self.tp.device_group)
            x = x + partial
        if pp.rank_in_group < pp.world_size - 1:
            dist.send(x, dst=pp.ranks[pp.rank_in_group + 1], group=pp.device_group)
            x = None
        if par.data_parallel_size > 1 and (par.coupled or par.one_world):  # across replicas: every rank of every
            # serving replica takes part (a tensor: the device half); a replica left alone sums its own. Last in
            # the step: a replica lost mid-step then fails this collective alone, and strands no rank of this
            # replica inside its own (a peer that left the TP all-reduce would hang it)
            dist.all_reduce(total, group=dp.device_group)
            self.last_dp_sum = float(total.item())
        x = None if x is None else x.cpu()
        self.last_output = x
        self.last_step_s = time.perf_counter() - t0
        return x

    def sample_tokens(self, grammar_output: Any = None) -> list[int]:
        """Greedy 'tokens' of the last output (argmax per row); [] on ranks without an output."""
        out = getattr(self, "last_output", None)
        return [] if out is None else out.argmax(dim=-1).tolist()

    def execute_dummy_batch(self) -> None:
        self.execute_model(make_batch(0, batch=1, d=self.layers[0][0].shape[1] if self.layers else D_MODEL))

    def step_report(self) -> dict[str, float]:
        """The last execute_model: seconds spent in this worker, and the cross-replica sum (DP only)."""
        return {"seconds": self.last_step_s, "dp_sum": self.last_dp_sum}
