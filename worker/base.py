"""`WorkerBase`: the interface an engine's worker implements.

The executor constructs it in the worker process as
``Worker(config, local_rank, rank, distributed_init_method, is_driver_worker, **worker_kwargs)``
and then calls `init_device` and `load_model`; after that every method is an
RPC target (`collective_rpc("execute_model", ...)`). Override what the engine
needs; the defaults are what a CPU-only toy needs.
"""

from __future__ import annotations

import logging
from typing import Any

from rayfree import settings
from rayfree.cluster.config import ClusterConfig

__all__ = ["WorkerBase"]

logger = logging.getLogger("rayfree.worker")


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
        #: this worker's GPU, by its index among the devices the process sees (the node placed it: its own
        #: device, disjoint from every other worker's of the node, DP replicas' included); None without GPUs.
        #: Use it, not `local_rank`, to pick the device.
        self.device_index: int | None = settings.get("RAYFREE_LOCAL_DEVICE")
        #: where this worker's tensors live (set by init_device)
        self.device: Any = None

    #: the backend of every group's device half; None: "nccl" when the worker has a CUDA device, else no second
    #: group (the device group is the gloo group)
    device_backend: str | None = None
    #: what this worker runs on, when it can run on one thing only: "cpu" (a CPU engine: the node places and
    #: counts no GPU for it, whatever it has) or "cuda"; None: the cluster's `device` setting decides (auto: GPUs
    #: when the node has one for each worker). Assign it a literal in the class body: the node reads it there
    #: without importing the worker's module.
    runs_on: str | None = None

    def init_device(self) -> None:
        """Select this worker's device (`cuda:{device_index}` when CUDA is present, else the CPU), join the
        torch.distributed world (its DP replica's ranks; every replica's when they share one world) and build the
        parallel groups, each a pair: a gloo `cpu_group` for the control plane and a `device_group` for tensors
        (NCCL on CUDA)."""
        import torch

        from rayfree.cluster.join import shape_of
        from rayfree.cluster.parallel_state import init_distributed_environment, initialize_model_parallel

        backend = self.device_backend
        on_cpu = self.config.device == "cpu"  # (the node resolved where its workers run: devices.resolve_device)
        if self.device_index is not None and not on_cpu and torch.cuda.is_available():
            torch.cuda.set_device(self.device_index)
            self.device = torch.device("cuda", self.device_index)
            backend = backend or "nccl"
        else:
            if self.device_index is None and not on_cpu and torch.cuda.is_available():
                logger.warning(
                    "rank %d: CUDA is available but this node placed no GPU on it (the driver's "
                    "/proc/driver/nvidia/gpus lists none): it runs on the CPU",
                    self.rank,
                )
            self.device = torch.device("cpu")
        par = self.parallel_config
        # `rank` is the rank within this DP replica (the executor's). Replicas in one world share it; the others
        # (independent, coupled) meet at one rendezvous (every rank named if one is missing), each forms its own.
        independent = par.data_parallel_size > 1 and not par.one_world
        init_distributed_environment(
            *((par.world_size, self.rank) if independent else (par.world_size_across_dp, par.global_rank(self.rank))),
            self.distributed_init_method,
            self.local_rank,
            timeout_s=self.config.join_timeout_s,
            force_remote=self.config.force_remote or None,
            shape=shape_of(par),
            node=par.node_rank if par.nnodes > 1 else -1,
            device_backend=backend,
            rendezvous=_rendezvous(par, self.rank) if independent else None,
        )
        initialize_model_parallel(self.parallel_config)
        if par.coupled and par.replica_epoch == 0:  # (a replica that rejoins joins them once node 0 says)
            from rayfree.cluster.across_replicas import regroup

            regroup(par, self.rank, 0, list(range(par.data_parallel_size)), self.config.join_timeout_s)

    def on_replicas_changed(self, epoch: int, members: list[int]) -> None:
        """Coupled DP replicas: the groups across replicas (`get_dp_group()`, `get_ep_group()`) were just formed
        again over the replicas `members` (membership `epoch`), after a replica was lost, drained or rejoined.
        An engine with experts spread over the replicas redistributes them here; the default does nothing."""

    def rayfree_regroup(self, epoch: int, members: list[int]) -> None:
        """(Called by the executor before the first call of a new membership; not the engine's to call.)"""
        from rayfree.cluster.across_replicas import regroup

        regroup(self.parallel_config, self.rank, epoch, members)
        self.on_replicas_changed(epoch, members)

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


def _rendezvous(par: Any, rank: int) -> tuple[int, int, str, bool, bool]:
    """Independent replicas: where this rank meets its world's. The first incarnations of every replica meet
    together (a missing rank is named); a replica that rejoins (epoch > 0) meets alone, under its epoch's name, at
    the store node 0's first rank hosts (that rank hosts it anew when node 0 itself was started again)."""
    if par.replica_epoch == 0:
        return par.world_size_across_dp, par.global_rank(rank), f"dp{par.dp_rank}", False, False
    return par.world_size, rank, f"dp{par.dp_rank}.e{par.replica_epoch}", True, par.global_rank(rank) == 0
