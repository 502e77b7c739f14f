"""The smallest useful worker: for benchmarks and smoke tests of the RPC path."""

from __future__ import annotations

from typing import Any

from rayfree.worker.base import WorkerBase


class EchoWorker(WorkerBase):
    """Joins no process group unless distributed=True is passed as a worker kwarg."""

    def init_device(self) -> None:
        if self.kwargs.get("distributed", False):
            super().init_device()

    def echo(self, x: Any) -> Any:
        return x

    def ack(self, payload: Any) -> bytes:
        """The reply bench/transport.py's reader sends: bench/rpc.py compares like with like."""
        return b"ok"

    def nbytes(self, payload: Any) -> int:
        """Size of what arrived (tensors, bytes-likes), so the reply stays tiny."""
        n = getattr(payload, "nbytes", None)
        return int(n) if n is not None else len(payload) if hasattr(payload, "__len__") else 0
