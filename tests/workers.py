"""Worker classes for the executor tests (importable by spawned workers as tests.workers:...)."""

from __future__ import annotations

import os
import signal
import time

from rayfree.worker.base import WorkerBase


class EchoWorker(WorkerBase):
    """Joins torch.distributed only with distributed=True (most tests do not need it: faster start)."""

    def init_device(self) -> None:
        if self.kwargs.get("distributed", False):
            super().init_device()

    def load_model(self) -> None:
        if self.rank in self.kwargs.get("fail_load_on", ()):
            raise RuntimeError(f"cannot load the model on rank {self.rank}")
        if self.rank in self.kwargs.get("die_load_on", ()):
            os._exit(7)
        time.sleep(self.kwargs.get("load_delay", 0.0))

    def echo(self, x):
        return x

    def whoami(self):
        return {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(),
                "driver": self.is_driver_worker, "kwargs": {k: v for k, v in self.kwargs.items()}}

    def sleep(self, seconds: float, only_rank: int | None = None):
        if only_rank is None or only_rank == self.rank:
            time.sleep(seconds)
        return self.rank

    def fail(self, message: str, only_rank: int | None = None):
        if only_rank is None or only_rank == self.rank:
            raise ValueError(message)
        return self.rank

    def poke_then_sleep(self, pid: int, signum: int, seconds: float, only_rank: int = 0):
        """Signal the caller once this call is under way (so it is interrupted mid-wait), then be slow."""
        if self.rank == only_rank:
            os.kill(pid, signum)
            time.sleep(seconds)
        return "late"

    def unimportable_result(self):
        """A result whose class lives in a module only this process has: the caller cannot unpickle it."""
        import sys
        import types
        mod = sys.modules.setdefault("only_in_this_worker", types.ModuleType("only_in_this_worker"))
        if not hasattr(mod, "Thing"):
            mod.Thing = type("Thing", (), {"__module__": "only_in_this_worker"})
        return mod.Thing()

    def die(self, only_rank: int):
        """SIGKILL this worker in the middle of a call."""
        if self.rank == only_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank

    def unpicklable(self):
        return lambda: None  # a lambda cannot be sent back with pickle

    def hang_ignoring_sigterm(self):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)

    def execute_model(self, scheduler_output):
        return ("executed", self.rank, scheduler_output)
