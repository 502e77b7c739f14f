"""rayfree's cluster configuration for a vLLM engine: the parallel sizes from vLLM, the rest from RAYFREE_*.

vLLM refuses nnodes > 1 with a third-party executor, so its configuration
always says one node; where the ranks run (nnodes, node_rank, master_addr,
the secret, timeouts) is rayfree's business, read from its own environment
variables or config file as `rayfree node` reads them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.cluster.loading import load_config
from rayfree.launch.launchers import LaunchError
from rayfree.launch.placement import place

__all__ = ["cluster_config", "follower_vllm_config", "COLLECTIVE_METHODS", "VLLM_SPIN_US"]

#: vLLM's steps that run collectives: an exception on one rank leaves its peers blocked, so it is fatal
COLLECTIVE_METHODS = ["execute_model", "sample_tokens", "execute_dummy_batch", "compile_or_warm_up_model"]
#: The spin cap for vLLM (unless RAYFREE_SPIN_US says otherwise): about one engine step. vLLM's steps take
#: milliseconds (tens of them across nodes), far above rayfree's default 200 us cap, so with that cap the
#: waiting workers and the engine parked during every step and each step paid the wake-ups; vLLM's own
#: queues spin without any cap (bench/vllm.py's figures per cap: docs/benchmarks.md). The spin still adapts
#: (at most 4x the recent waits); lower the cap to give cores back to other work.
VLLM_SPIN_US = 20000.0
#: Stall reports for vLLM (unless RAYFREE_STALL_REPORT_S / RAYFREE_STALL_DUMP_S say otherwise): vLLM warns
#: about a stuck broadcast after 60 s, and its start-up calls (profiling, compilation, warm-up) legitimately
#: take minutes on GPUs, so reports start at 60 s and stacks are dumped after 10 minutes.
VLLM_STALL_REPORT_S = 60.0
VLLM_STALL_DUMP_S = 600.0


def _sizes(par: Any) -> dict[str, Any]:
    return {
        "tensor_parallel_size": par.tensor_parallel_size,
        "pipeline_parallel_size": par.pipeline_parallel_size,
        "prefill_context_parallel_size": getattr(par, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(par, "decode_context_parallel_size", 1),
        "enable_expert_parallel": bool(getattr(par, "enable_expert_parallel", False)),
    }


def cluster_config(vllm_config: Any, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """The executor's ClusterConfig: vLLM's sizes, rayfree's placement (environment / RAYFREE_CONFIG)."""
    par = vllm_config.parallel_config
    if par.nnodes > 1:
        raise ConfigError(
            f"vLLM's nnodes={par.nnodes}: with rayfree, leave vLLM at one node and give rayfree the "
            f"nodes (RAYFREE_NNODES, RAYFREE_MASTER_ADDR, and `rayfree node --headless` on the others)"
        )
    env = os.environ if env is None else env
    try:  # rayfree's placement from the launcher (Slurm, LeaderWorkerSet, ...) where RAYFREE_* say nothing
        placement = place(argparse.Namespace(), env)
    except LaunchError as e:
        raise ConfigError(str(e)) from None
    given = {**placement.filled, **{k: str(v).lower() for k, v in _sizes(par).items()}}  # vLLM's sizes win
    config = load_config([f"--{k.replace('_', '-')}={v}" for k, v in given.items()], env=env)
    if config.parallel.data_parallel_size > 1:
        raise ConfigError(
            "RAYFREE_DATA_PARALLEL_SIZE > 1: vLLM runs one executor per DP rank; give vLLM its "
            "data_parallel_size and leave rayfree's at 1"
        )
    parallel = msgspec.structs.replace(config.parallel, **_sizes(par))
    scheduler = getattr(vllm_config, "scheduler_config", None)
    config = msgspec.structs.replace(
        config,
        parallel=parallel,
        collective_methods=list(COLLECTIVE_METHODS),
        async_scheduling=bool(getattr(scheduler, "async_scheduling", False)),
        spin_us=VLLM_SPIN_US if config.spin_us is None else config.spin_us,
        stall_report_s=config.stall_report_s if "RAYFREE_STALL_REPORT_S" in env else VLLM_STALL_REPORT_S,
        stall_dump_s=config.stall_dump_s if "RAYFREE_STALL_DUMP_S" in env else VLLM_STALL_DUMP_S,
    )
    return config.validate(check_local_master=True)


def follower_vllm_config(config: ClusterConfig, engine_args: dict[str, Any]) -> Any:
    """On a `rayfree node --headless` follower: vLLM's configuration from the engine arguments the leader's
    engine was started with (as `vllm serve --headless` builds it), with rayfree's parallel sizes."""
    from vllm.engine.arg_utils import EngineArgs

    par = config.parallel
    given = {k: engine_args[k] for k in ("tensor_parallel_size", "pipeline_parallel_size") if k in engine_args}
    want = {"tensor_parallel_size": par.tensor_parallel_size, "pipeline_parallel_size": par.pipeline_parallel_size}
    if any(given[k] != want[k] for k in given):
        raise ConfigError(
            f"--worker-kwargs says {given} but this node was started with {want}: give both the "
            f"same sizes (or leave them out of --worker-kwargs)"
        )
    backend = "rayfree.integrations.vllm.RayfreeExecutor"  # by name: vLLM resolves it (executor.py imports us)
    return EngineArgs(**{**engine_args, **want, "distributed_executor_backend": backend}).create_engine_config()
