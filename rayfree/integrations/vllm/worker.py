"""`VllmWorker`: vLLM's own worker (the platform's: CPUWorker here, the GPU worker on GPU nodes) in a
rayfree worker process.

rayfree builds it as `VllmWorker(config, local_rank, rank, distributed_init_method, is_driver_worker,
vllm_config=...)` and calls `init_device`, `load_model`, then every RPC by name; this class does what
vLLM's own worker process does around the same calls (its worker wrapper, the block size, the
environment cache) and forwards everything else to vLLM's worker. vLLM joins torch.distributed
itself; across nodes rayfree then builds its own (gloo) groups on that world for its queues.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from rayfree.cluster.config import ClusterConfig
from rayfree.transport.shm.segment import SHM_DIR

__all__ = ["VllmWorker"]


class VllmWorker:
    """See the module docstring. On a follower node (no `vllm_config`), the keyword arguments are vLLM's
    engine arguments, from which vLLM's configuration is built as the leader's engine built its own."""

    def __init__(
        self,
        config: ClusterConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool,
        vllm_config: Any = None,
        **engine_args: Any,
    ) -> None:
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        if vllm_config is None:
            from .config import follower_vllm_config

            vllm_config = follower_vllm_config(config, engine_args)
        elif engine_args:
            raise TypeError(f"VllmWorker takes vllm_config or engine arguments, not both: {sorted(engine_args)}")
        self.config = config
        self.rank = rank
        self.vllm_config = vllm_config
        if config.parallel.nnodes_within_dp > 1:
            # vLLM's own queues across nodes publish on VLLM_HOST_IP, else on the address of its route to
            # the internet, which a cluster network may not have: use the one rayfree uses, toward node 0
            from rayfree.transport import get_ip

            os.environ.setdefault("VLLM_HOST_IP", get_ip(peer=config.parallel.master_addr))
        wrapper = WorkerWrapperBase(rpc_rank=local_rank, global_rank=rank)
        kwargs: list[dict[str, Any]] = [{} for _ in range(max(config.parallel.world_size, local_rank + 1))]
        kwargs[local_rank] = {
            "vllm_config": vllm_config,
            "local_rank": local_rank,
            "rank": rank,
            "distributed_init_method": vllm_init_method(distributed_init_method, config),
            "is_driver_worker": is_driver_worker,
        }
        wrapper.init_worker(kwargs)
        self._wrapper = wrapper

    def init_device(self) -> None:
        self._wrapper.init_device()  # vLLM joins torch.distributed and builds its own groups
        par = self.config.parallel
        if par.nnodes_within_dp > 1:  # rayfree's queues between nodes are built over its own groups
            from rayfree.cluster.parallel_state import adopt_distributed_environment

            adopt_distributed_environment(
                par, timeout_s=self.config.join_timeout_s, force_remote=self.config.force_remote or None
            )

    def load_model(self) -> None:
        self._wrapper.load_model()
        from vllm.platforms import current_platform

        if hasattr(current_platform, "update_block_size_for_backend"):  # as vLLM's worker process does
            current_platform.update_block_size_for_backend(self.vllm_config)
        try:
            from vllm.envs import enable_envs_cache
        except ImportError:  # older vLLM
            return
        enable_envs_cache()

    def finish_output(self, output: Any) -> Any:
        """vLLM's asynchronous output (still being copied off the device) becomes the output itself."""
        from vllm.v1.outputs import AsyncModelRunnerOutput

        return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output

    def shutdown(self) -> None:
        """vLLM's worker, then vLLM's groups and its torch.distributed world (as vLLM's worker process does;
        its shared-memory broadcasters are released there)."""
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        try:
            self._wrapper.shutdown()
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
            remove_cpu_segments(os.environ.get("VLLM_DIST_IDENT", ""))  # the engine is stopping: peers too

    def leftovers(self) -> list[str]:
        """vLLM's CPU collectives' shared memory ("<port>-tp:0-...cpushm_<rank>"), which only a clean
        shutdown of every worker of the group unlinks: rayfree removes it when the executor died."""
        return cpu_segments(os.environ.get("VLLM_DIST_IDENT", ""))

    def __getattr__(self, name: str) -> Any:
        if name == "_wrapper":  # not set yet: construction failed
            raise AttributeError(name)
        return getattr(self._wrapper, name)


def vllm_init_method(init_method: str, config: ClusterConfig) -> str:
    """The rendezvous address vLLM's worker joins, marked with the node across nodes.

    vLLM believes it runs on one node, and its CPU collectives would put every TP/PP group in shared
    memory named after the rendezvous port (VLLM_DIST_IDENT), which ranks on other nodes cannot open.
    torch ignores the query, but it makes the name differ from node to node, so vLLM keeps shared
    memory for groups within a node and uses torch.distributed for those that cross nodes.
    """
    par = config.parallel
    return init_method if par.nnodes_within_dp == 1 else f"{init_method}?rayfree_node={par.node_rank_within_dp}"


def cpu_segments(ident: str) -> list[str]:
    """The shared-memory paths vLLM's CPU communicators of the world `ident` (its rendezvous port) made."""
    if not ident:
        return []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [os.path.join(SHM_DIR, n) for n in names if n.startswith(f"{ident}-") and "cpushm" in n]


def remove_cpu_segments(ident: str) -> list[str]:
    """Unlink what `cpu_segments(ident)` lists; the paths removed."""
    removed = []
    for path in cpu_segments(ident):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
