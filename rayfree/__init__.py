"""rayfree: run an LLM engine's workers across processes and nodes without Ray.

    from rayfree import MultiprocExecutor, ClusterConfig, ParallelConfig, WorkerBase

The four layers live below this root, each importing only the ones beneath it:
`rayfree.transport` <- `rayfree.cluster` <- `rayfree.worker` <- `rayfree.executor`;
`rayfree.cli` (the `rayfree` command, node runner, doctor, demo) sits above them.

The public names are the imports in the `TYPE_CHECKING` block below: the one
list (type checkers read it as it is; at run time it is read from this file's
source and each name is loaded on first use, PEP 562, so `import
rayfree.transport` does not pull in torch through the executor).
"""

from __future__ import annotations

import ast
import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:  # pragma: no cover - the list of public names
    from rayfree.cluster.config import (
        ClusterConfig as ClusterConfig,
    )
    from rayfree.cluster.config import (
        ConfigError as ConfigError,
    )
    from rayfree.cluster.config import (
        ParallelConfig as ParallelConfig,
    )
    from rayfree.cluster.group import Group as Group
    from rayfree.cluster.group import GroupLeft as GroupLeft
    from rayfree.cluster.parallel_state import (
        get_dcp_group as get_dcp_group,
    )
    from rayfree.cluster.parallel_state import (
        get_dp_group as get_dp_group,
    )
    from rayfree.cluster.parallel_state import (
        get_ep_group as get_ep_group,
    )
    from rayfree.cluster.parallel_state import (
        get_pcp_group as get_pcp_group,
    )
    from rayfree.cluster.parallel_state import (
        get_pp_group as get_pp_group,
    )
    from rayfree.cluster.parallel_state import (
        get_tp_group as get_tp_group,
    )
    from rayfree.cluster.parallel_state import (
        get_world_group as get_world_group,
    )
    from rayfree.cluster.pg_queues import MessageQueue as MessageQueue
    from rayfree.executor.abstract import (
        Executor as Executor,
    )
    from rayfree.executor.abstract import (
        FailureCallback as FailureCallback,
    )
    from rayfree.executor.abstract import (
        ReplicaState as ReplicaState,
    )
    from rayfree.executor.abstract import (
        UniProcExecutor as UniProcExecutor,
    )
    from rayfree.executor.errors import (
        CallInterrupted as CallInterrupted,
    )
    from rayfree.executor.errors import (
        ExecutorError as ExecutorError,
    )
    from rayfree.executor.errors import (
        ExecutorFailed as ExecutorFailed,
    )
    from rayfree.executor.errors import (
        FatalWorkerError as FatalWorkerError,
    )
    from rayfree.executor.errors import (
        LeaderLost as LeaderLost,
    )
    from rayfree.executor.errors import (
        NodeLost as NodeLost,
    )
    from rayfree.executor.errors import (
        NotLeaderError as NotLeaderError,
    )
    from rayfree.executor.errors import (
        ReplicaDrained as ReplicaDrained,
    )
    from rayfree.executor.errors import (
        ReplicaFailed as ReplicaFailed,
    )
    from rayfree.executor.errors import (
        ReplicaLost as ReplicaLost,
    )
    from rayfree.executor.errors import (
        ReplicasChanged as ReplicasChanged,
    )
    from rayfree.executor.errors import (
        RpcTimeout as RpcTimeout,
    )
    from rayfree.executor.errors import (
        StartupTimeout as StartupTimeout,
    )
    from rayfree.executor.errors import (
        WorkerDied as WorkerDied,
    )
    from rayfree.executor.errors import (
        WorkerError as WorkerError,
    )
    from rayfree.executor.errors import (
        WorkerStartupError as WorkerStartupError,
    )
    from rayfree.executor.futures import FutureWrapper as FutureWrapper
    from rayfree.executor.multiproc import MultiprocExecutor as MultiprocExecutor
    from rayfree.executor.replicas import NodeReplicas as NodeReplicas
    from rayfree.transport.errors import (
        HandleError as HandleError,
    )
    from rayfree.transport.errors import (
        MessageTooLarge as MessageTooLarge,
    )
    from rayfree.transport.errors import (
        OutOfSequence as OutOfSequence,
    )
    from rayfree.transport.errors import (
        QueueBroken as QueueBroken,
    )
    from rayfree.transport.errors import (
        QueueClosed as QueueClosed,
    )
    from rayfree.transport.errors import (
        QueueShutdown as QueueShutdown,
    )
    from rayfree.transport.errors import (
        QueueTimeout as QueueTimeout,
    )
    from rayfree.transport.errors import (
        SegmentNotFound as SegmentNotFound,
    )
    from rayfree.transport.errors import (
        ShmSpaceError as ShmSpaceError,
    )
    from rayfree.transport.errors import (
        TransportError as TransportError,
    )
    from rayfree.transport.queue.handle import Handle as Handle
    from rayfree.transport.secure.policy import SecretError as SecretError
    from rayfree.transport.zmq.sockets import SocketError as SocketError
    from rayfree.worker.base import WorkerBase as WorkerBase


def _exports() -> dict[str, str]:
    """public name -> module that defines it, from the block above."""
    with open(os.path.join(os.path.dirname(__file__), "__init__.py")) as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {
        a.name: imp.module for imp in block.body if isinstance(imp, ast.ImportFrom) and imp.module for a in imp.names
    }


_EXPORTS = _exports()
__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the block above, read at run time


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rayfree' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
