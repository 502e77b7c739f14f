"""rayfree's top layer: the executors an engine calls, the `rayfree` command and the demo.

    from executor import MultiprocExecutor
    ex = MultiprocExecutor(config, "my_engine.worker:Worker", {"model": "..."})
    out = ex.collective_rpc("execute_model", args=(batch,), unique_reply_rank=ex.output_rank)
    ex.shutdown()
"""

from .abstract import Executor, FailureCallback, UniProcExecutor
from .errors import (ExecutorError, ExecutorFailed, LeaderLost, NodeLost, NotLeaderError, RpcTimeout, WorkerDied,
                     WorkerError)
from .future import FutureWrapper
from .multiproc import MultiprocExecutor

__all__ = ["Executor", "FailureCallback", "UniProcExecutor", "MultiprocExecutor", "FutureWrapper",
           "ExecutorError", "ExecutorFailed", "NotLeaderError", "RpcTimeout", "WorkerDied", "WorkerError",
           "NodeLost", "LeaderLost"]
