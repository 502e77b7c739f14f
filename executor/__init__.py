"""rayfree's top layer: the executors an engine calls, and the worker group each one owns.

from . import MultiprocExecutor
ex = MultiprocExecutor(config, "my_engine.worker:Worker", {"model": "..."})
out = ex.collective_rpc("execute_model", args=(batch,), unique_reply_rank=ex.output_rank)
ex.shutdown()
"""

if __name__ != "rayfree.executor":  # the repository's folder imported as a top-level package: two copies of rayfree
    raise ImportError(
        f"import rayfree.executor, not {__name__}: this folder installs as rayfree.executor "
        f"(pip install -e . puts it there)"
    )


from .abstract import Executor, FailureCallback, UniProcExecutor
from .errors import (
    CallInterrupted,
    ExecutorError,
    ExecutorFailed,
    FatalWorkerError,
    LeaderLost,
    NodeLost,
    NotLeaderError,
    ReplicaDrained,
    ReplicaFailed,
    ReplicaLost,
    ReplicasChanged,
    RpcTimeout,
    StartupTimeout,
    WorkerDied,
    WorkerError,
    WorkerStartupError,
)
from .futures import FutureWrapper
from .multiproc import MultiprocExecutor
from .replicas import NodeReplicas
from .workers import WorkerGroup

__all__ = [
    "Executor",
    "FailureCallback",
    "UniProcExecutor",
    "MultiprocExecutor",
    "FutureWrapper",
    "ExecutorError",
    "ExecutorFailed",
    "CallInterrupted",
    "FatalWorkerError",
    "NotLeaderError",
    "RpcTimeout",
    "WorkerDied",
    "WorkerError",
    "NodeLost",
    "LeaderLost",
    "ReplicaFailed",
    "ReplicaLost",
    "ReplicaDrained",
    "ReplicasChanged",
    "WorkerStartupError",
    "StartupTimeout",
    "WorkerGroup",
    "NodeReplicas",
]
