"""The cluster config the executor tests start from: one TP group on this machine, bounds that fit a loaded
two-core machine (start-up 120 s) and a short staged shutdown."""

from __future__ import annotations

from typing import Any

from rayfree.cluster.config import ClusterConfig, ParallelConfig


def cfg(path: str = "shm", tp: int = 2, pp: int = 1, **kw: Any) -> ClusterConfig:
    """`path` "tcp" forces the socket path (every rank as if on another node), "shm" the node's ring."""
    kw.setdefault("ready_timeout_s", 120)
    kw.setdefault("shutdown_grace_s", 2)
    kw.setdefault("shutdown_term_s", 2)
    par = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return ClusterConfig(parallel=par, force_remote=path == "tcp", **kw)
