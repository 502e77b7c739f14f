"""vLLM's GPU worker, timed as tests/support/vllm_timed.py times the CPU one (bench/gpu_check.py, on a GPU)."""

from __future__ import annotations

import time

from vllm.v1.worker.gpu_worker import Worker

from tests.support.vllm_timed import TimedSteps


class TimedGPUWorker(TimedSteps, Worker):
    """A step's time is the GPU's too: synchronise before reading the clock, or a launch looks free."""

    def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        import torch

        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return Worker.execute_model(self, scheduler_output)
        finally:
            torch.cuda.synchronize()
            self._model_s += time.perf_counter() - t
            self._steps += 1

    def sample_tokens(self, grammar_output):  # type: ignore[no-untyped-def]
        import torch

        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return Worker.sample_tokens(self, grammar_output)
        finally:
            torch.cuda.synchronize()
            self._model_s += time.perf_counter() - t
