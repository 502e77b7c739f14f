"""The leader entries of `make gpu-check`'s simulated nodes (bench/gpu_check.py starts them).

torch and the toy engine are imported here at the top, as docs/operations.md ("Entry points") asks of every entry point:
`rayfree node` imports this module before its heartbeats start, whereas an import inside the entry would hold
Python's lock for seconds while they run, and the node's peers could call it lost.
"""

from __future__ import annotations

import json
import threading
import time

import torch  # noqa: F401 - imported before the node's heartbeats start (the module docstring)

from rayfree import ExecutorFailed
from rayfree.cli.toy_engine import make_batch, reference_forward


def drive(executor) -> None:
    """The simulated nodes' entry: a few checked steps across the two nodes' GPUs."""
    for step in range(20):
        batch = make_batch(step)
        executor.collective_rpc("execute_model", args=(batch,), timeout=120)
        tokens = executor.collective_rpc("sample_tokens", timeout=120, unique_reply_rank=0)
        assert tokens == reference_forward(batch["x"]).argmax(dim=-1).tolist(), step
    print("gpu-check: two nodes, 20 steps checked", flush=True)


def replica_steps(executor) -> int:
    """The one-GPU simulated nodes' entry (two independent DP replicas of TP=1 sharing the GPU): replica 0 steps
    until replica 1 was lost and is back, then 20 more; replica 1 steps until it is lost (its node is killed), or,
    rejoined, 20 steps. Every step's tokens checked."""
    k, epoch = executor.dp_rank, executor.parallel_config.replica_epoch
    seen: list[str] = []
    changed = threading.Event()
    executor.register_replica_callback(lambda r, st: (seen.append(f"{r}:{st.state}:{st.epoch}"), changed.set()))
    print(f"STEPPING:{json.dumps({'replica': k, 'epoch': epoch})}", flush=True)
    steps, after, until = 0, 0, time.monotonic() + 240
    try:
        while time.monotonic() < until:
            back = k == 0 and any(s.startswith("1:serving:") for s in seen)
            if (k == 0 and back and after >= 20) or (k == 1 and epoch > 0 and steps >= 20):
                break
            batch = make_batch(steps, replica=k)
            executor.collective_rpc("execute_model", args=(batch,), timeout=120)
            tokens = executor.collective_rpc("sample_tokens", timeout=120, unique_reply_rank=0)
            assert tokens == reference_forward(batch["x"]).argmax(dim=-1).tolist(), (k, steps)
            steps += 1
            after += back
    except ExecutorFailed as e:
        print(f"RESULT:{json.dumps({'replica': k, 'epoch': epoch, 'failed': type(e).__name__})}", flush=True)
        return 1
    print(f"RESULT:{json.dumps({'replica': k, 'epoch': epoch, 'steps': steps, 'seen': seen})}", flush=True)
    return 0
