"""A tensor-parallel linear layer on rayfree: each TP rank holds a slice of the input dimension, and an
all-reduce over the TP group sums the partial products (docs/workers.md walks through it).

    python examples/tp_layer.py        # prints the largest difference from the unsharded layer
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig, WorkerBase, get_tp_group

IN, OUT = 64, 16


def full_layer() -> torch.nn.Linear:
    """The unsharded layer, the same on every rank and in the engine (a fixed seed)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(IN, OUT, bias=False)
    torch.nn.init.normal_(layer.weight)
    return layer


class TPLinearWorker(WorkerBase):
    def load_model(self) -> None:
        self.tp = get_tp_group()
        weight = full_layer().weight.detach()
        self.width = IN // self.tp.world_size
        self.lo = self.tp.rank_in_group * self.width
        # this rank's columns, on its device (cuda:{device_index} on a GPU node, the CPU here)
        self.weight = weight[:, self.lo : self.lo + self.width].clone().to(self.device)

    def execute_model(self, x: torch.Tensor) -> torch.Tensor:
        partial = x[:, self.lo : self.lo + self.width].to(self.device) @ self.weight.T
        dist.all_reduce(partial, group=self.tp.device_group)  # the sum over the TP ranks: the full product
        return partial.cpu()


def main(tp: int = 2) -> float:
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=tp))
    x = torch.randn(4, IN)
    with MultiprocExecutor(config, TPLinearWorker) as ex:
        y = ex.execute_model(x)
    want = full_layer()(x).detach()
    return float((y - want).abs().max())


if __name__ == "__main__":
    diff = main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(f"TP layer: largest difference from the unsharded layer {diff:.2e}")
    sys.exit(0 if diff < 1e-4 else 1)
