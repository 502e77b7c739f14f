"""How a worker process is started: the multiprocessing context, the environment it starts with, and its
re-import of the engine's main module (moved into the worker, under its lifeline)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

from rayfree import settings

__all__ = ["start_context", "worker_env", "main_in_worker"]


def start_context() -> Any:
    """The multiprocessing context workers start with (RAYFREE_WORKER_MULTIPROC_METHOD, default spawn)."""
    method = settings.get("RAYFREE_WORKER_MULTIPROC_METHOD")
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"RAYFREE_WORKER_MULTIPROC_METHOD={method!r}: use spawn, fork or forkserver")
    return multiprocessing.get_context(method)


@contextlib.contextmanager
def main_in_worker(kwargs: dict[str, Any]) -> Iterator[None]:
    """While one worker is spawned: its re-import of the engine's main module (spawn's preparation step, which
    runs the script's module-level imports, torch's included) is moved into `worker_main`, after its signal
    handlers and lifeline are in place, so an engine that dies meanwhile is noticed (and nothing of it left
    behind). multiprocessing asks `get_preparation_data` just before it pickles the process object, so the
    main module's name or path goes into this worker's own arguments instead (`kwargs` is the process
    object's own dict: `Process` keeps a copy of what it was given)."""
    import multiprocessing.spawn as spawn

    real = spawn.get_preparation_data

    def prepare(name: str) -> dict[str, Any]:
        data = real(name)
        for key in ("init_main_from_name", "init_main_from_path"):
            if key in data:
                kwargs["main_module"] = (key, data.pop(key))
        return data

    spawn.get_preparation_data = prepare  # type: ignore[assignment]
    try:
        yield
    finally:
        spawn.get_preparation_data = real  # type: ignore[assignment]


@contextlib.contextmanager
def worker_env() -> Iterator[None]:
    """While workers start: one OpenMP thread each unless OMP_NUM_THREADS is set (N workers x all cores
    of threads only fight each other). The parent's own environment is restored afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if saved is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
