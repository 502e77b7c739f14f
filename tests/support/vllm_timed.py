"""vLLM's worker, timed: how long each step spends in the model (bench/vllm.py, bench/gpu_check.py).

`execute_model` and `sample_tokens` add their time and count; `bench_timing()` reports the totals since
`bench_reset()`. Set as vLLM's worker class for both executors, so the step time outside the workers
(engine + executor) can be compared between them in one run. `TimedCPUWorker` here; its GPU twin is in
tests/support/vllm_timed_gpu.py (vLLM's CPU build cannot import the GPU worker).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker


class TimedSteps:
    """The timing, for any vLLM worker class it is mixed into (first)."""

    _model_s = 0.0
    _steps = 0
    rank: int

    def _clock(self) -> float:
        return time.perf_counter()

    def execute_model(self, scheduler_output: Any) -> Any:
        t = self._clock()
        try:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        finally:
            self._model_s += self._clock() - t
            self._steps += 1

    def sample_tokens(self, grammar_output: Any) -> Any:
        t = self._clock()
        try:
            return super().sample_tokens(grammar_output)  # type: ignore[misc]
        finally:
            self._model_s += self._clock() - t

    def bench_reset(self) -> None:
        self._model_s, self._steps = 0.0, 0

    def bench_timing(self) -> dict[str, float]:
        return {"rank": self.rank, "model_s": self._model_s, "steps": self._steps}


class TimedCPUWorker(TimedSteps, CPUWorker):
    pass
