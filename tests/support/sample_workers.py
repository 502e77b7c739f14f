"""Worker classes for the executor tests (importable by spawned workers as tests.support.sample_workers:...)."""

from __future__ import annotations

import os
import signal
import time

from rayfree.worker.base import WorkerBase


def _slow_restore(seconds: float, fail: bool = False) -> float:
    time.sleep(seconds)
    if fail:
        raise RuntimeError(f"unpickling failed on purpose after {seconds}s")
    return seconds


class SlowToUnpickle:
    """Unpickling it takes `seconds`: a spawned worker that gets it in its kwargs is still starting (before
    worker_main runs) for that long."""

    def __init__(self, seconds: float, fail: bool = False) -> None:
        self.seconds = seconds
        self.fail = fail

    def __reduce__(self):
        return (_slow_restore, (self.seconds, self.fail))


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
        if self.kwargs.get("say_loading"):
            print(f'LOADING:{{"rank": {self.rank}}}', flush=True)  # (a test waits for it: the node is starting)
        time.sleep(self.kwargs.get("load_delay", 0.0))
        if self.rank in self.kwargs.get("die_in_handshake_on", ()):
            from rayfree.transport import MessageQueue

            def die(*_a, **_k):
                os._exit(9)

            MessageQueue.wait_until_ready = die  # after READY, with its reply ring made: gone mid-handshake

    def echo(self, x):
        return x

    def whoami(self):
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "driver": self.is_driver_worker,
            "kwargs": {k: v for k, v in self.kwargs.items()},
        }

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
        if isinstance(scheduler_output, dict) and scheduler_output.get("fail_rank") == self.rank:
            raise RuntimeError(f"execute_model broke on rank {self.rank}")
        if isinstance(scheduler_output, dict) and "sleep" in scheduler_output:
            time.sleep(scheduler_output["sleep"])
        return ("executed", self.rank, scheduler_output)

    def take_draft_token_ids(self):
        time.sleep(self.kwargs.get("draft_delay", 0.0))
        return [1, 2, 3]

    # -- for the fault tests (tests/executor/test_faults.py) --------------------------------------------

    def step_fail_then_allreduce(self, fail_rank: int, seconds: float = 60.0):
        """A collective step: rank `fail_rank` raises before the all-reduce its peers block in."""
        import torch
        import torch.distributed as dist

        if self.rank == fail_rank:
            raise RuntimeError(f"rank {self.rank} broke before the all-reduce")
        t = torch.ones(1)
        if dist.is_initialized():
            dist.all_reduce(t)  # the peers wait here for the rank that raised
        else:
            time.sleep(seconds)
        return float(t.item())

    def allreduce_for(self, seconds: float, marker_dir: str = "") -> int:
        """A collective step that keeps every rank inside all-reduces for `seconds` (a long model step); after
        the first, each rank creates `marker_dir/<rank>` (so a test knows they are all inside)."""
        import torch
        import torch.distributed as dist

        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            dist.all_reduce(torch.ones(1))
            n += 1
            if n == 1 and marker_dir:
                open(os.path.join(marker_dir, str(self.rank)), "w").close()
        return n

    def fail_while_peers_wait(self, fail_rank: int, stuck_rank: int) -> float:
        """A collective step: `fail_rank` raises; `stuck_rank` waits in a native receive from a third rank that
        never sends (a collective that will never complete: no Python signal handler runs in it); the others
        sleep."""
        import torch
        import torch.distributed as dist

        if self.rank == fail_rank:
            raise RuntimeError(f"rank {self.rank} broke while the others waited")
        if self.rank == stuck_rank:
            t = torch.zeros(1)
            src = next(r for r in range(self.parallel_config.world_size) if r not in (fail_rank, stuck_rank))
            dist.recv(t, src=src)
            return float(t.item())
        time.sleep(60)
        return 0.0

    def exit_now(self, code: int, only_rank: int = 0):
        if self.rank == only_rank:
            import sys

            sys.exit(code)
        return self.rank

    def bad_str_error(self):
        class BadStr(Exception):
            def __str__(self):
                raise RuntimeError("str() of this exception raises")

        raise BadStr()

    def big(self, n: int):
        return bytes(n)

    def where(self, t):
        """Where a received tensor's bytes live (in a shared-memory mapping of this process: the ring, or not),
        and their sum."""
        from tests.support.memory import in_shared_memory

        return {"shared": in_shared_memory(t.data_ptr()), "sum": float(t.double().sum())}

    def busy(self, seconds: float):
        """Busy in Python (not in a sleep): a signal or an interrupt lands at once."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return self.rank


class PairedGroupsWorker(EchoWorker):
    """Builds every group as a pair with a second backend, as a GPU worker does with NCCL (gloo here)."""

    device_backend = "gloo"


class CpuEchoWorker(EchoWorker):
    """A CPU engine's worker: the node places and counts no GPU for it."""

    runs_on = "cpu"
