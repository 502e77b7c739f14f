"""vLLM's GPU worker, timed as tests/support/vllm_timed.py times the CPU one (bench/gpu_check.py, on a GPU)."""

from __future__ import annotations

import time

from vllm.v1.worker.gpu_worker import Worker

from tests.support.vllm_timed import TimedSteps


class TimedGPUWorker(TimedSteps, Worker):
    """A step's time is the GPU's too: synchronise before reading the clock, or a launch looks free."""

    def _clock(self) -> float:
        import torch

        torch.cuda.synchronize()
        return time.perf_counter()
