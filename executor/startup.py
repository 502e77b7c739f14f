"""What an executor's start-up needs around its worker group: where the workers meet, the checks made before
anything is spawned, and callbacks that do not keep the executor alive.

Plain functions of the configuration; the order of start-up, and what a failure in it means, stay in
multiproc.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.transport import get_open_port
from rayfree.transport.secure.policy import require_secret
from rayfree.worker.proc import check_worker_path

from .errors import WorkerStartupError

__all__ = ["init_method", "preflight", "weak_callback"]


def init_method(config: ClusterConfig) -> str:
    """Where the workers join torch.distributed (tcp://host:port): one world for every replica and node."""
    par = config.parallel
    if par.nnodes > 1 or par.data_parallel_size > 1:
        return f"tcp://{par.master_addr}:{par.master_port or 29500}"
    return f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}"


def preflight(config: ClusterConfig, worker_cls: type | str) -> None:
    """Refuse, before any worker starts, what would fail in every worker: a wrong class path (one error here, not
    one traceback per worker), a cluster of several nodes without a secret."""
    if isinstance(worker_cls, str):
        try:
            check_worker_path(worker_cls)
        except ConfigError as e:
            raise WorkerStartupError(f"{e} (refused before starting any worker)") from None
    if config.parallel.nnodes > 1:
        require_secret(f"a cluster of {config.parallel.nnodes} nodes")


def weak_callback(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound) for a thread or an object the executor owns, without that keeping the executor alive
    (None once the executor is gone)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        m = ref()
        return None if m is None else m(*args)

    return call
