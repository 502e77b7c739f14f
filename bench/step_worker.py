"""What bench/step.py's rigs compute, and its entry on simulated nodes: a module of its own, so that a worker or
a node process imports it without the bench (its rigs, vLLM's)."""

from __future__ import annotations

import json
import os
import sys
import time

from rayfree import WorkerBase


class Burner:
    """Real compute for a given time: torch.mm into a tensor made beforehand, on one thread, calibrated here."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.a, self.b, self.c = torch.randn(48, 48), torch.randn(48, 48), torch.empty(48, 48)
        for _ in range(200):
            torch.mm(self.a, self.b, out=self.c)
        n, t0 = 2000, time.perf_counter()
        for _ in range(n):
            torch.mm(self.a, self.b, out=self.c)
        self.per_s = (time.perf_counter() - t0) / n

    def burn(self, ms: float) -> float:
        """Compute for about `ms` milliseconds; the seconds it took."""
        mm, a, b, c = self.torch.mm, self.a, self.b, self.c
        t0 = time.perf_counter()
        for _ in range(max(1, int(ms / 1e3 / self.per_s))):
            mm(a, b, out=c)
        return time.perf_counter() - t0


class StepWorker(WorkerBase):
    """Computes for the time asked, and says how long it took. On one node it joins no torch.distributed world
    (its calls need none); across nodes it does, for its remote queues are formed over the world's groups."""

    def init_device(self) -> None:
        if self.parallel_config.nnodes > 1:
            super().init_device()
        self.burner = Burner()

    def step(self, ms: float) -> float:
        return self.burner.burn(ms)


def entry(ex) -> int:  # noqa: ANN001 - the executor, as rayfree node gives it
    """Node 0's entry on two simulated nodes: every step length in RF_STEP_PLAN ({ms: [warm, calls]}), each call
    to every rank (one per node); a line per length with each call's cost (wall minus the slowest rank's compute)
    and this process's CPU meanwhile (its waiting: the caller's, as the other rigs'); then IDLE, and it returns
    once the bench has measured the idle cluster (a line on stdin)."""
    plan = json.loads(os.environ["RF_STEP_PLAN"])
    for ms, (warm, calls) in plan.items():
        for _ in range(warm):
            ex.collective_rpc("step", args=(float(ms),), timeout=60)
        costs = []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            a = time.perf_counter()
            took = ex.collective_rpc("step", args=(float(ms),), timeout=60)
            costs.append(time.perf_counter() - a - max(took))
        share = (time.process_time() - c0) / (time.perf_counter() - t0)
        print("STEP", json.dumps({"ms": float(ms), "costs": costs, "cpu": share}), flush=True)
    print("IDLE", flush=True)
    sys.stdin.readline()
    return 0
