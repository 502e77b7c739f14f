"""rayfree: run an LLM engine's workers across processes and nodes without Ray.

    from rayfree import MultiprocExecutor, ClusterConfig, ParallelConfig, WorkerBase

The four layers live below this root, each importing only the ones beneath it:
`rayfree.transport` <- `rayfree.cluster` <- `rayfree.worker` <- `rayfree.executor`;
`rayfree.cli` (the `rayfree` command, node runner, doctor, demo) sits above them.

Names are loaded on first use (PEP 562), so `import rayfree.transport` does not
pull in torch through the executor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: public name -> module that defines it
_EXPORTS = {
    "MultiprocExecutor": "rayfree.executor.multiproc",
    "UniProcExecutor": "rayfree.executor.abstract",
    "Executor": "rayfree.executor.abstract",
    "FailureCallback": "rayfree.executor.abstract",
    "FutureWrapper": "rayfree.executor.rpc",
    "ExecutorError": "rayfree.executor.errors",
    "ExecutorFailed": "rayfree.executor.errors",
    "WorkerError": "rayfree.executor.errors",
    "WorkerDied": "rayfree.executor.errors",
    "RpcTimeout": "rayfree.executor.errors",
    "NodeLost": "rayfree.executor.errors",
    "LeaderLost": "rayfree.executor.errors",
    "ReplicaFailed": "rayfree.executor.errors",
    "NodeReplicas": "rayfree.executor.replicas",
    "NotLeaderError": "rayfree.executor.errors",
    "WorkerStartupError": "rayfree.executor.errors",
    "StartupTimeout": "rayfree.executor.errors",
    "ClusterConfig": "rayfree.cluster.config",
    "ParallelConfig": "rayfree.cluster.config",
    "ConfigError": "rayfree.cluster.config",
    "WorkerBase": "rayfree.worker.base",
    "MessageQueue": "rayfree.cluster.pg_queues",  # the class, with its process-group constructors attached
    "Handle": "rayfree.transport.queue.handle",
    "TransportError": "rayfree.transport.errors",
    "QueueTimeout": "rayfree.transport.errors",
    "QueueShutdown": "rayfree.transport.errors",
    "QueueClosed": "rayfree.transport.errors",
    "QueueBroken": "rayfree.transport.errors",
    "MessageTooLarge": "rayfree.transport.errors",
    "HandleError": "rayfree.transport.errors",
    "SocketError": "rayfree.transport.zmq.sockets",
    "SegmentNotFound": "rayfree.transport.errors",
    "ShmSpaceError": "rayfree.transport.errors",
    "SecretError": "rayfree.transport.secure.policy",
    "FatalWorkerError": "rayfree.executor.errors",
    # a worker's groups (tensor, pipeline, data, expert parallel, ...), each with cpu_group / device_group
    "Group": "rayfree.cluster.group",
    "get_world_group": "rayfree.cluster.parallel_state",
    "get_tp_group": "rayfree.cluster.parallel_state",
    "get_pp_group": "rayfree.cluster.parallel_state",
    "get_dp_group": "rayfree.cluster.parallel_state",
    "get_ep_group": "rayfree.cluster.parallel_state",
    "get_pcp_group": "rayfree.cluster.parallel_state",
    "get_dcp_group": "rayfree.cluster.parallel_state",
}

__all__ = sorted(_EXPORTS)  # one list: the table above

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
    from rayfree.cluster.group import Group
    from rayfree.cluster.parallel_state import (get_dcp_group, get_dp_group, get_ep_group, get_pcp_group,
                                                get_pp_group, get_tp_group, get_world_group)
    from rayfree.executor.abstract import Executor, FailureCallback, UniProcExecutor
    from rayfree.executor.errors import (ExecutorError, ExecutorFailed, FatalWorkerError, LeaderLost, NodeLost,
                                         NotLeaderError, ReplicaFailed, RpcTimeout, StartupTimeout, WorkerDied,
                                         WorkerError, WorkerStartupError)
    from rayfree.executor.replicas import NodeReplicas
    from rayfree.executor.rpc import FutureWrapper
    from rayfree.executor.multiproc import MultiprocExecutor
    from rayfree.transport.errors import (HandleError, MessageTooLarge, QueueBroken, QueueClosed, QueueShutdown,
                                          QueueTimeout, SegmentNotFound, ShmSpaceError, TransportError)
    from rayfree.transport.secure.policy import SecretError
    from rayfree.transport.queue.handle import Handle
    from rayfree.transport.zmq.sockets import SocketError
    from rayfree.transport.queue.message_queue import MessageQueue
    from rayfree.worker.base import WorkerBase


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rayfree' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
