"""`WorkerGroup`: one node's worker processes, owned by one object from spawn to the last SIGKILL.

It starts a process per local rank with two one-way pipes each — *status* (child -> parent: a msgspec
`Ready` or `StartupFailed`, later `Fatal`) and *death* (parent -> child: never written; EOF tells the child
its parent is gone, see worker/main.py) — waits for every READY on the pipes and the process sentinels at once
(a worker that dies first is named at once, with its pid, title and exit code), watches the processes and
their status pipes once they run, dumps the stacks of workers stuck at start-up, removes what a dead worker
left in /dev/shm, and closes them in stages: death pipes, wait, SIGTERM, wait, SIGKILL. Policy (what a death
means for calls in flight) is the executor's; this module only reports.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.heartbeat_beater import WAIT_LOG_S
from rayfree.cluster.peers import peer_gone
from rayfree.transport.secure import policy as security
from rayfree.transport.shm.segment import remove_entries_of
from rayfree.worker.main import EXIT_REIMPORTED_MAIN, Deferred, worker_main
from rayfree.worker.messages import Fatal, Ready, StartupFailed, decode
from rayfree.worker.titles import title_for

from .errors import StartupTimeout, WorkerStartupError
from .monitor import CONSEQUENCE_HOLD_S, WorkerMonitor
from .spawning import main_in_worker, placed, placements, start_context, worker_env

__all__ = ["WorkerGroup", "WorkerHandle", "ExitedProcess", "StartupAborted", "exit_description", "start_context"]

logger = logging.getLogger("rayfree.executor")


def exit_description(code: int | None) -> str:
    """'exit code 3' / 'signal SIGKILL' / 'still running'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


#: how long a worker that reported its start-up failure is given to exit, so its exit code can be named
_STARTUP_EXIT_WAIT_S = 2.0

#: One group spawns at a time in a process: a node running several DP replicas starts their executors from
#: threads, and starting processes (the environment, multiprocessing's spawn preparation and its
#: resource tracker) is not safe to interleave.
_SPAWN_LOCK = threading.Lock()


class StartupAborted(Exception):
    """`abort()` was called while the group waited for its workers (the executor failed meanwhile)."""


class ExitedProcess:
    """What is kept of a worker process once the group released it (`Process.close()` frees its pipe and
    sentinel descriptors, after which the process object refuses every question)."""

    def __init__(self, proc: BaseProcess) -> None:
        self.pid = proc.pid
        self.exitcode = proc.exitcode
        self.name = proc.name

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        return None


@dataclass
class WorkerHandle:
    """One worker process as its parent sees it."""

    rank: int
    proc: BaseProcess | ExitedProcess
    #: the status pipe (READY, then Fatal); None once closed
    ready_pipe: Connection | None
    death_writer: Connection | None
    title: str = "Worker"
    #: its device (index among the devices it sees; None without GPUs), placed by the node (devices.py)
    device: int | None = None
    #: set at READY: its reply queue's handle, (worker 0, multi-node) every rank's, and (a follower's first
    #: worker, relay) the leader's queue handle and where this node's relay subscribes to it
    reply_handle: bytes | None = None
    peer_reply_handles: list[bytes] = field(default_factory=list)
    upstream: tuple[bytes, str] | None = None

    def describe(self) -> str:
        return f"worker rank {self.rank} (pid {self.proc.pid}, rayfree::{self.title})"


class WorkerGroup:
    """The worker processes of ranks `ranks` on this node (see the module docstring): it owns the processes,
    as torch elastic's PContext does; the queues to them belong to the leader's RPC pipe (rpc.py)."""

    def __init__(
        self,
        config: ClusterConfig,
        worker_cls: type | str | bytes,
        worker_kwargs: dict[str, Any],
        ranks: list[int],
        distributed_init_method: str,
        broadcast_handle: bytes | None,
        on_ready: Callable[[WorkerHandle], None] | None = None,
    ) -> None:
        self.config = config
        self.ranks = list(ranks)
        #: told of each worker at its READY (the leader attaches to its reply queue then, while it surely exists)
        self.on_ready = on_ready
        self.workers: list[WorkerHandle] = []
        self._monitor: WorkerMonitor | None = None
        self._closed = False
        self._abort = multiprocessing.Pipe(duplex=False)  # closing the writer wakes wait_ready
        self._spawn(worker_cls, worker_kwargs, distributed_init_method, broadcast_handle)

    # -- start-up -------------------------------------------------------------------------

    def _spawn(self, worker_cls: Any, worker_kwargs: dict[str, Any], init_method: str, handle: bytes | None) -> None:
        """Start every local worker before waiting for any: they join the world together."""
        context = start_context()
        par = self.config.parallel
        inherited: list[int] | None = [] if context.get_start_method() == "fork" else None
        policy = security.current()  # handed to each worker explicitly (never through os.environ)
        places, device = placements(self.config)
        self.config = config = msgspec.structs.replace(self.config, device=device)  # (the worker's: where it runs)
        with _SPAWN_LOCK, worker_env():
            for local_rank, rank in enumerate(self.ranks):
                ready_r, ready_w = context.Pipe(duplex=False)
                death_r, death_w = context.Pipe(duplex=False)
                if inherited is not None:  # fork: the child closes the parent ends of earlier workers' pipes
                    inherited += [ready_r.fileno(), death_w.fileno()]
                # Pickled by the spawn like every argument, unpickled by worker_main under its lifeline.
                payload = Deferred(
                    dict(
                        config=config,
                        worker_cls=worker_cls,
                        worker_kwargs=worker_kwargs,
                        local_rank=local_rank,
                        rank=rank,
                        distributed_init_method=init_method,
                        input_shm_handle=handle,
                        is_driver_worker=par.is_driver_rank(rank),
                        security_policy=policy,
                    )
                )
                kwargs = dict(
                    rank=rank,
                    start_method=context.get_start_method(),
                    ready_pipe=ready_w,
                    death_pipe=death_r,
                    inherited_fds=list(inherited or []),
                    payload=payload,
                    placement={"env": places[local_rank].env, "cpus": places[local_rank].cpus},
                )
                proc = context.Process(target=worker_main, kwargs=kwargs, name=f"RayfreeWorker-{rank}", daemon=True)
                try:
                    spawning = context.get_start_method() == "spawn"
                    with main_in_worker(proc._kwargs) if spawning else contextlib.nullcontext():  # type: ignore[attr-defined]
                        with placed(places[local_rank]):
                            proc.start()
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    for c in (ready_r, death_w):
                        c.close()
                    raise WorkerStartupError(
                        f"cannot start worker rank {rank}: its arguments must be picklable "
                        f"(worker_kwargs, worker class): {e}",
                        rank,
                    ) from e
                finally:
                    ready_w.close()
                    death_r.close()
                title = title_for(par, rank)
                self.workers.append(WorkerHandle(rank, proc, ready_r, death_w, title, places[local_rank].device))

    def wait_ready(self, timeout: float | None) -> None:
        """Every worker's READY; WorkerStartupError naming whoever failed, StartupTimeout naming who was late
        (after dumping their stacks to their stderr). The status pipes stay open for later reports."""
        pending = {w.ready_pipe: w for w in self.workers if w.ready_pipe is not None}
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        abort_r = self._abort[0]
        held: tuple[WorkerStartupError, float] | None = None  # a consequence ("connection closed by peer")
        while pending:
            now = time.monotonic()
            if held is not None and now >= held[1]:
                raise held[0]  # no cause of it showed up here: another node's (the heartbeats judge that)
            left = None if deadline is None else max(0.0, deadline - now)
            slice_s = WAIT_LOG_S if left is None else min(left, WAIT_LOG_S)
            if held is not None:
                slice_s = min(slice_s, held[1] - now)
            sentinels = {w.proc.sentinel: w for w in pending.values()}  # type: ignore[union-attr]
            ready = multiprocessing.connection.wait([*pending, *sentinels, abort_r], timeout=slice_s)
            if abort_r in ready:
                raise StartupAborted("the executor failed while its workers were starting")
            if held is not None and not ready:
                continue
            if not ready and (deadline is None or time.monotonic() < deadline):
                bound = "" if timeout is None else f" of {timeout:.0f}s (ready_timeout_s)"
                waiting = (sorted(w.rank for w in pending.values()), time.monotonic() - started, bound)
                logger.info("waiting for worker rank(s) %s to be ready (join, model load) for %.0fs%s", *waiting)
                continue
            if not ready:
                late = sorted(w.rank for w in pending.values())
                self.dump_stacks([w for w in pending.values()])
                raise StartupTimeout(
                    f"worker rank(s) {late} did not become ready within {timeout:.0f}s "
                    f"(ready_timeout_s); they may be stuck loading the model or joining the world "
                    f"(their stacks are on their stderr)",
                    late,
                )
            for obj in ready:
                if isinstance(obj, int):  # a sentinel: that process exited
                    w = sentinels[obj]
                    if w.ready_pipe in pending and not w.ready_pipe.poll(0):
                        self._died_before_ready(w)
                    continue  # its message (if any) is read through the pipe
                if obj in pending:
                    err = self._on_ready_message(pending.pop(obj))
                    if err is None:
                        continue
                    if not err.consequence:
                        raise err  # a rank's own failure: the cause, whatever was held
                    if held is None:  # wait, briefly, for the failure that caused it (monitor.py's rule)
                        held = (err, time.monotonic() + CONSEQUENCE_HOLD_S)
        if held is not None:
            raise held[0]

    def abort(self) -> None:
        """Wake `wait_ready` (any thread): it raises StartupAborted, and its caller shuts the group down."""
        with contextlib.suppress(OSError):
            self._abort[1].close()

    def _died_before_ready(self, w: WorkerHandle) -> None:
        w.proc.join(1)
        self._close_status(w)
        self._remove_leftovers(w)
        why = ""
        if w.proc.exitcode == EXIT_REIMPORTED_MAIN:
            main = getattr(sys.modules.get("__main__"), "__file__", None) or "the engine's main module"
            why = (
                f": the spawned worker re-ran {main}, which starts an executor when imported (spawn imports "
                f'the main module again in every worker); put the engine\'s start under `if __name__ == "__main__":`'
            )
        raise WorkerStartupError(
            f"{w.describe()} died before becoming ready ({exit_description(w.proc.exitcode)}){why}", w.rank
        )

    def _on_ready_message(self, w: WorkerHandle) -> WorkerStartupError | None:
        """Its READY taken in (None), or its start-up failure, to raise."""
        pipe = w.ready_pipe
        assert pipe is not None
        try:
            msg = decode(pipe.recv_bytes())
        except EOFError:
            self._died_before_ready(w)
            return None
        if isinstance(msg, StartupFailed):
            self._close_status(w)
            w.proc.join(_STARTUP_EXIT_WAIT_S)  # it leaves right after its report: name its exit too
            err = WorkerStartupError(
                f"{w.describe()} failed to start ({exit_description(w.proc.exitcode)}): "
                f"{msg.error_type}: {msg.message}",
                msg.rank,
                msg.traceback,
            )
            err.consequence = peer_gone(msg.error_type, msg.message, timeouts=False)
            return err
        if not isinstance(msg, Ready):
            self._close_status(w)
            raise WorkerStartupError(f"{w.describe()} sent {type(msg).__name__} before READY", w.rank)
        w.reply_handle, w.peer_reply_handles = msg.response_handle, list(msg.peer_response_handles)
        w.upstream = (msg.upstream_handle, msg.upstream_endpoint) if msg.upstream_handle else None
        if self.on_ready is not None:
            self.on_ready(w)
        return None

    @staticmethod
    def _close_status(w: WorkerHandle) -> None:
        if w.ready_pipe is not None:
            w.ready_pipe.close()
            w.ready_pipe = None

    @staticmethod
    def _remove_leftovers(w: WorkerHandle) -> None:
        """A dead worker's segments and ipc directories (named with its pid): nothing may outlive it."""
        if w.proc.pid is not None and not w.proc.is_alive():
            removed = remove_entries_of({w.proc.pid})
            if removed:
                logger.info("removed what %s left behind: %s", w.describe(), ", ".join(removed))

    def start_monitor(
        self, on_death: Callable[[WorkerHandle], None], on_fatal: Callable[[WorkerHandle, Fatal], None]
    ) -> None:
        """A thread that reports the first death or fatal failure of a worker, its cause first (monitor.py)."""
        self._monitor = WorkerMonitor(list(self.workers), on_death, on_fatal, self._remove_leftovers)
        self._monitor.start()

    def dump_stacks(self, workers: list[WorkerHandle] | None = None) -> None:
        """Have each live worker print every thread's stack to its stderr (faulthandler on SIGUSR1)."""
        procs = [w.proc for w in (self.workers if workers is None else workers)]
        for p in procs:
            if p.is_alive() and p.pid is not None:
                logger.error("worker %s (pid %d) is stuck; its stack follows on its stderr", p.name, p.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)
        if procs:
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)  # let them write it

    # -- the staged close --------------------------------------------------------------------

    def close_steps(self, grace_s: float, term_s: float) -> Iterator[float]:
        """The staged close, as steps for the policy's thread (each yields how long to wait before the next look):
        stop the monitor (our own stop is no failure), close the death pipes (the workers see EOF and leave), wait
        up to `grace_s`, SIGTERM, wait up to `term_s`, SIGKILL; then release every process. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.stop()
        for w in self.workers:
            if w.death_writer is not None:
                w.death_writer.close()
            w.death_writer = None
        procs: list[BaseProcess] = [w.proc for w in self.workers if isinstance(w.proc, BaseProcess)]
        yield from _until_exited(procs, grace_s)
        alive = [p for p in procs if p.is_alive()]
        if alive:
            names = [p.name for p in alive]
            if grace_s > 0:
                logger.warning("workers %s still running %.1fs after shutdown; sending SIGTERM", names, grace_s)
            else:
                logger.info("stopping workers %s at once (SIGTERM)", names)
            for p in alive:
                p.terminate()
            yield from _until_exited(alive, term_s)
        alive = [p for p in procs if p.is_alive()]
        if alive:
            logger.warning("workers %s ignored SIGTERM for %.1fs; sending SIGKILL", [p.name for p in alive], term_s)
            for p in alive:
                p.kill()
            yield from _until_exited(alive, 5.0)
        self._release()

    def close(self, grace_s: float, term_s: float) -> None:
        """`close_steps`, run here (a group no policy thread looks after)."""
        for delay in self.close_steps(grace_s, term_s):
            time.sleep(delay)

    def _release(self) -> None:
        if self._monitor is not None:
            self._monitor.join(2.0)  # it waits on the processes' sentinels, which the lines below release
        for w in self.workers:
            self._close_status(w)
            self._remove_leftovers(w)
            if isinstance(w.proc, BaseProcess) and not w.proc.is_alive():
                exited = ExitedProcess(w.proc)
                w.proc.close()  # its sentinel and pipe descriptors go now, not at a later garbage collection
                w.proc = exited
        if self._monitor is not None:
            self._monitor.release()
        for end in self._abort:
            end.close()


#: how often the staged close looks whether its workers have exited
_POLL_S = 0.02


def _until_exited(procs: list[BaseProcess], limit: float) -> Iterator[float]:
    end = time.monotonic() + limit
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        yield min(_POLL_S, max(0.0, end - time.monotonic()))
