"""`WorkerBase`: the interface an engine's worker implements.

The executor constructs it in the worker process as
``Worker(config, local_rank, rank, distributed_init_method, is_driver_worker, **worker_kwargs)``
and then calls `init_device` and `load_model`; after that every method is an
RPC target (`collective_rpc("execute_model", ...)`). Override what the engine
needs; the defaults are what a CPU-only toy needs.
"""

from __future__ import annotations

from typing import Any

from rayfree.cluster.config import ClusterConfig

__all__ = ["WorkerBase"]


class WorkerBase:
    """One rank's worker: device, model and the step methods the executor calls."""

    def __init__(
        self,
        config: ClusterConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.parallel_config = config.parallel
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.kwargs = kwargs

    def init_device(self) -> None:
        """Join the torch.distributed world (gloo, every DP replica's ranks) and build the parallel groups.

        GPU engines override this to select `cuda:{local_rank}` first and then
        call `super().init_device()`.
        """
        from rayfree.cluster.join import shape_of
        from rayfree.cluster.parallel_state import init_distributed_environment, initialize_model_parallel

        par = self.parallel_config
        # `rank` is the rank within this DP replica (the executor's); the world spans every replica.
        init_distributed_environment(
            par.world_size_across_dp,
            par.global_rank(self.rank),
            self.distributed_init_method,
            self.local_rank,
            timeout_s=self.config.join_timeout_s,
            force_remote=self.config.force_remote or None,
            shape=shape_of(par),
            node=par.node_rank if par.nnodes > 1 else -1,
        )
        initialize_model_parallel(self.parallel_config)

    def load_model(self) -> None:
        """Build or load the model (the default has none)."""

    def execute_model(self, scheduler_output: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement execute_model")

    def sample_tokens(self, grammar_output: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement sample_tokens")

    def execute_dummy_batch(self) -> None:
        """Run a step with no requests (warm-up, or keeping a pipeline in step)."""

    def take_draft_token_ids(self) -> Any:
        """Draft tokens of speculative decoding, if any."""
        return None

    def check_health(self) -> None:
        """Raise if this worker cannot serve."""

    def shutdown(self) -> None:
        """Release what load_model took (the process groups are released by rayfree)."""
