"""vLLM's CPU worker, timed: how long each step spends in the model (bench/vllm.py, `--worker-cls`).

`execute_model` and `sample_tokens` add their time and count; `bench_timing()` reports the totals since
`bench_reset()`. Set as vLLM's worker class for both executors, so the step time outside the workers
(engine + executor) can be compared between them in one run.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker


class TimedCPUWorker(CPUWorker):
    _model_s = 0.0
    _steps = 0

    def execute_model(self, scheduler_output: Any) -> Any:
        t = time.perf_counter()
        try:
            return super().execute_model(scheduler_output)
        finally:
            self._model_s += time.perf_counter() - t
            self._steps += 1

    def sample_tokens(self, grammar_output: Any) -> Any:
        t = time.perf_counter()
        try:
            return super().sample_tokens(grammar_output)
        finally:
            self._model_s += time.perf_counter() - t

    def bench_reset(self) -> None:
        self._model_s, self._steps = 0.0, 0

    def bench_timing(self) -> dict[str, float]:
        return {"rank": self.rank, "model_s": self._model_s, "steps": self._steps}
