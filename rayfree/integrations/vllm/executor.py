"""`RayfreeExecutor`: vLLM's executor contract on rayfree's MultiprocExecutor.

vLLM's engine calls it as it calls its own `mp` executor: collective RPCs by
name or callable, futures for `non_block`, the step on the output rank (with
vLLM's KV / EC connector aggregators), health checks, and a failure callback
into the engine-dead path. What it adds is rayfree's: a worker or node lost
fails the engine within a second (a node: within the heartbeat timeout)
instead of vLLM's RPC timeout; queues between nodes are sealed (AES-256-GCM) and heartbeats use CURVE;
a stopped head stops its followers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import vllm.envs as envs
from vllm.v1.executor.abstract import Executor

from rayfree.executor.multiproc import MultiprocExecutor

from .config import cluster_config
from .worker import remove_cpu_segments, vllm_init_method

__all__ = ["RayfreeExecutor", "WORKER"]

logger = logging.getLogger("rayfree.integrations.vllm")

WORKER = "rayfree.integrations.vllm.worker:VllmWorker"


class RayfreeExecutor(Executor):
    """`LLM(..., distributed_executor_backend=RayfreeExecutor)` (or the string
    "rayfree.integrations.vllm.RayfreeExecutor")."""

    uses_ray = False
    supports_pp = True

    def _init_executor(self) -> None:
        from vllm.v1.executor.multiproc_executor import set_multiprocessing_worker_envs

        config = cluster_config(self.vllm_config)
        self.world_size = config.parallel.world_size
        set_multiprocessing_worker_envs(config.parallel.local_ranks)  # vLLM's own choice of worker threads
        self.rayfree = _Executor(config, WORKER, {"vllm_config": self.vllm_config})
        try:  # as vLLM's mp executor does once its workers run: this process only schedules
            from vllm.utils.torch_utils import set_torch_threads_for_runtime
        except ImportError:  # older vLLM
            pass
        else:
            set_torch_threads_for_runtime()
        self.output_rank = self.rayfree.output_rank
        logger.info(
            "vLLM on rayfree: %d worker(s) on %d node(s), output rank %d",
            self.world_size,
            config.parallel.nnodes,
            self.output_rank,
        )

    # -- what vLLM's engine asks of an executor ------------------------------------------------

    @property
    def is_failed(self) -> bool:
        return self.rayfree.is_failed

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self.rayfree.register_failure_callback(callback)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        kv_output_aggregator: Any = None,
        ec_output_aggregator: Any = None,
    ) -> Any:
        aggregators = [a for a in (kv_output_aggregator, ec_output_aggregator) if a is not None]
        aggregate = None
        if aggregators:  # every rank replies; each connector merges its part onto the output rank's
            aggregate = _chain(aggregators, unique_reply_rank or 0)
            unique_reply_rank = None
        return self.rayfree.collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank, aggregate)

    def _step(self, method: str, arg: Any, non_block: bool) -> Any:
        return self.collective_rpc(
            method,
            args=(arg,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
            kv_output_aggregator=self.kv_output_aggregator,
            ec_output_aggregator=self.ec_output_aggregator,
        )

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        return self._step("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        return self._step("sample_tokens", grammar_output, non_block)

    def execute_dummy_batch(self) -> None:
        self.collective_rpc(
            "execute_dummy_batch", unique_reply_rank=self.output_rank, timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
        )

    def take_draft_token_ids(self) -> Any:
        return self.collective_rpc(
            "take_draft_token_ids", unique_reply_rank=self.output_rank, timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
        )

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10)

    def shutdown(self) -> None:
        rf = getattr(self, "rayfree", None)
        if rf is not None:
            rf.shutdown()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True


def _chain(aggregators: list[Any], rank: int) -> Callable[[list[Any]], Any]:
    """vLLM's connector aggregators, one after the other, onto rank `rank`'s output (as vLLM's mp does)."""

    def aggregate(outputs: list[Any]) -> Any:
        result = outputs[rank]
        for a in aggregators:
            result = a.aggregate(outputs, output_rank=rank)
        return result

    return aggregate


class _Executor(MultiprocExecutor):
    """rayfree's executor, which also removes what vLLM's workers leave behind when they are killed."""

    def release(self) -> None:
        """Run by the staged shutdown once every worker has exited, cleanly or killed (a stop or a failure)."""
        try:
            super().release()
        finally:
            _remove_cpu_segments(vllm_init_method(self.distributed_init_method, self.config))


def _remove_cpu_segments(init_method: str) -> None:
    """vLLM's CPU collectives name their shared memory after the rendezvous address and unlink it in the
    workers' own shutdown, which a killed worker never reaches: once every worker has stopped, what is
    left of this engine's is removed."""
    for path in remove_cpu_segments(init_method.split(":")[-1]):  # the name vLLM's CPU worker gives it
        logger.info("removed %s, left by a worker that did not stop cleanly", path)
