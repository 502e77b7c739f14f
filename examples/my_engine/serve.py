"""The docs' `my_engine.serve:main`: the driver `rayfree node --entry` calls with the executor. It runs a few steps,
checks each against the one-process model, prints one line and returns the exit code."""

from __future__ import annotations

import os

import torch

from rayfree.cli.toy_engine import make_batch, reference_forward


def main(ex) -> int:
    steps = int(os.environ.get("MY_ENGINE_STEPS", "10"))
    equal = sum(
        bool(
            torch.equal(
                ex.execute_model(make_batch(s, replica=ex.dp_rank)),
                reference_forward(make_batch(s, replica=ex.dp_rank)["x"]),
            )
        )
        for s in range(steps)
    )
    par = ex.parallel_config
    print(
        f"my_engine: replica {ex.dp_rank}: {equal} of {steps} steps equal to the one-process model on "
        f"{par.nnodes_within_dp} node(s), world size {par.world_size}",
        flush=True,
    )
    return 0 if equal == steps else 1
