"""A worker process's entry point: its signals, its status pipe, its watch on the parent, its exits.

Two one-way pipes join it to its parent. The *status* pipe (child -> parent)
carries msgspec messages: `Ready` once its queues are made, `StartupFailed`,
and later `Fatal` when a collective step raised. The *death* pipe (parent ->
child) is never written: EOF means the parent closed it (shutdown) or died.

Exits, whatever the worker is doing:
- the parent shuts down: the queues are shut, the busy loop returns; a
  worker busy in a long call gets SIGTERM from the staged close, which
  raises SystemExit in it;
- the parent died (SIGKILL included): the running method is interrupted and,
  if it has not let go within LIFELINE_GRACE_S, the process removes every
  shared-memory segment and ipc directory it or its dead parent made and
  leaves at once (os._exit), so nothing outlives them.
"""

from __future__ import annotations

import _thread
import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from rayfree import logs
from rayfree.procs import exit_now
from rayfree.supervisor import Failure, Severity, supervisor
from rayfree.transport import MessageQueue, QueueClosed
from rayfree.transport.secure import policy as security
from rayfree.transport.shm.segment import remove_entries_of

from .messages import Fatal, Ready, RemoteError, StartupFailed, encode
from .proc import FatalRpc, WorkerProc, destroy_distributed

__all__ = [
    "worker_main",
    "Lifeline",
    "Deferred",
    "refuse_reimported_main",
    "EXIT_FATAL",
    "EXIT_ORPHANED",
    "EXIT_REIMPORTED_MAIN",
]

logger = logging.getLogger("rayfree.worker")

#: exit codes the parent can tell apart
EXIT_FATAL = 1  # a collective step raised (its Fatal is on the status pipe)
EXIT_ORPHANED = 3  # the parent died
EXIT_REIMPORTED_MAIN = 4  # spawn re-ran the engine's main module, which starts an executor (refuse_reimported_main)
#: how long a worker whose parent died lets the running method unwind before it leaves anyway
LIFELINE_GRACE_S = 0.5
#: how often the lifeline looks whether the parent that let go has died (or only shut down)
_LOOK_S = 0.05


class Lifeline:
    """Watches the death pipe from the first moment (before the model loads) and knows every queue made since."""

    def __init__(self, death_pipe: Connection | None, exiting: threading.Event | None = None) -> None:
        self.death_pipe = death_pipe
        # The pid multiprocessing recorded when it spawned us, not getppid(): a parent that died while this
        # process was still importing would otherwise be taken for init, and its death for a shutdown.
        parent = multiprocessing.parent_process()
        self.parent = parent.pid if parent is not None and parent.pid else os.getppid()
        self.stopping = threading.Event()  # the parent is gone or shutting down: do not report failures
        self.parent_died = False
        #: this process is on its way out: signals no longer interrupt
        self.exiting = exiting if exiting is not None else threading.Event()
        self.main_done = threading.Event()
        self.queues: list[MessageQueue] = []
        #: the worker's `leftovers()`, if it has one: paths its engine made that only its own clean shutdown
        #: removes (vLLM's CPU collectives' shared memory); removed too when the parent died
        self.leftovers: Callable[[], list[str]] | None = None

    def start(self) -> Lifeline:
        """Watch the death pipe (built, then started: before the model loads)."""
        if self.death_pipe is not None:
            supervisor().start("RayfreeLifeline", self._watch)
        return self

    def watch(self, mq: MessageQueue) -> None:
        self.queues.append(mq)
        if self.stopping.is_set():
            mq.shutdown()

    def _watch(self) -> None:
        assert self.death_pipe is not None
        try:
            self.death_pipe.recv_bytes()
        except EOFError:
            pass
        except OSError:
            return  # closed by our own exit
        supervisor().post(Failure("the lifeline", None, Severity.STOP, self))

    # -- what the parent's letting go means (the policy thread) ------------------------------------------------

    def apply(self, failure: Failure) -> None:
        self.stopping.set()
        for mq in list(self.queues):
            mq.shutdown()  # a busy loop waiting for the next call returns
        self._look()

    def _look(self) -> None:
        """EOF comes both from a shutdown and from the parent's death; the kernel closes a dying process's files
        before it hands its children to a new parent, so keep looking until this process is done."""
        if self.main_done.is_set():
            return
        if os.getppid() == self.parent:
            supervisor().call_later(_LOOK_S, self._look)
            return
        self.parent_died = True
        # What the dead parent made goes first: whatever the main thread is doing (still importing the engine's
        # main module or unpickling its arguments, say), nothing of the parent's outlives it.
        removed = remove_entries_of({self.parent})
        logger.warning(
            "the executor (pid %d) died: stopping now%s",
            self.parent,
            f" (removed what it left: {', '.join(removed)})" if removed else "",
        )
        _thread.interrupt_main()  # a running method unwinds at its next Python step
        supervisor().call_later(LIFELINE_GRACE_S, self._leave)

    def _leave(self) -> None:
        if self.main_done.is_set():
            return
        # Stuck in native code, or ignoring the interrupt: take nothing along and leave.
        removed = remove_entries_of({self.parent, os.getpid()}) + self._remove_leftovers()
        logger.warning("leaving without unwinding (removed %d shared-memory name(s))", len(removed))
        logging.shutdown()
        os._exit(EXIT_ORPHANED)

    def remove_orphans(self) -> None:
        """The dead parent's segments and ipc directories (a ring it made before the handshake unlinked it)."""
        if self.parent_died:
            remove_entries_of({self.parent})
            self._remove_leftovers()

    def _remove_leftovers(self) -> list[str]:
        removed = []
        try:
            for path in self.leftovers() if self.leftovers is not None else []:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
        except Exception as e:  # noqa: BLE001 - leaving anyway
            logger.warning("removing the engine's leftovers: %s: %s", type(e).__name__, e)
        return removed


class Deferred:
    """The worker's arguments, pickled inside the parent's spawn (so fds and tensors travel as multiprocessing
    sends them) but unpickled by `worker_main` itself, under its lifeline: a parent that dies while the worker
    still unpickles them (importing the engine's modules, torch) is noticed, and an argument that fails to
    unpickle is a start-up failure the parent can name, not a crash inside multiprocessing's bootstrap."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._data: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import ForkingPickler

        return (Deferred._packed, (bytes(ForkingPickler.dumps(self._obj)),))

    @classmethod
    def _packed(cls, data: bytes) -> Deferred:
        d = cls.__new__(cls)
        d._obj, d._data = None, data
        return d

    def load(self) -> Any:
        if self._data is None:  # fork: never pickled
            return self._obj
        import pickle

        return pickle.loads(self._data)


def _apply_placement(placement: dict[str, Any] | None) -> None:
    """This worker's own variables and CPUs (executor/spawning.py set them at spawn already; a forkserver's
    child starts from the server's instead), before the engine's main module and torch are imported."""
    if not placement:
        return
    os.environ.update(placement["env"])
    if placement["cpus"] is not None:
        os.sched_setaffinity(0, placement["cpus"])


def worker_main(**kwargs: Any) -> None:
    """Entry point of the worker process (the parent's WorkerGroup passes these keyword arguments).

    The signal handlers come first and everything after them sits in one try/finally, so an interrupt from
    the lifeline (the parent died) always lands where the clean-up below runs."""
    _apply_placement(kwargs.pop("placement", None))  # first: every thread of the worker inherits its CPUs
    status: Connection | None = kwargs.pop("ready_pipe")
    death_pipe = kwargs.pop("death_pipe", None)
    forked = kwargs.pop("start_method", "spawn") == "fork"
    exiting = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        # The staged close's SIGTERM must stop a busy worker; only the exit path itself is left alone.
        if not exiting.is_set():
            exiting.set()
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lifeline = Lifeline(death_pipe, exiting).start()
    rank = kwargs.get("rank", -1)
    worker: WorkerProc | None = None
    code = 0
    ready = False
    try:
        for fd in kwargs.pop("inherited_fds", []):
            try:
                os.close(fd)
            except OSError as e:
                logger.warning("closing an inherited pipe: %s", e)
        main_module = kwargs.pop("main_module", None)
        if main_module is not None:
            _import_main(*main_module)
        payload = kwargs.pop("payload", None)
        if payload is not None:
            try:
                kwargs.update(payload.load())
            except Exception as e:
                raise WorkerArgumentsError(
                    f"worker rank {rank} could not unpickle its arguments (worker_kwargs, the worker class): "
                    f"{type(e).__name__}: {e}"
                ) from e
        security.use(kwargs.pop("security_policy", None))
        _set_launcher_environment(kwargs)
        logs.configure()
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
        worker = WorkerProc(lifeline=lifeline, **kwargs)
        assert status is not None and worker.worker_response_mq is not None
        status.send_bytes(
            encode(
                Ready(
                    rank,
                    worker.worker_response_mq.export_handle().to_bytes(),
                    [h.to_bytes() for h in worker.peer_response_handles],
                    *(worker.upstream or (b"", "")),
                )
            )
        )
        ready = True
        timeout = kwargs["config"].ready_timeout_s
        if worker.rpc_broadcast_mq is not None:
            worker.rpc_broadcast_mq.wait_until_ready(timeout=timeout)
        worker.worker_response_mq.wait_until_ready(timeout=timeout)
        worker.worker_busy_loop()
    except FatalRpc as f:
        _send(status, Fatal(rank, f.method, f.error.error_type, f.error.message, f.error.traceback))
        code = EXIT_FATAL
    except (KeyboardInterrupt, SystemExit) as e:
        if lifeline.stopping.is_set():
            logger.debug("worker rank %d: stopped", rank)
        else:
            logger.warning("worker rank %d was terminated", rank)
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    except Exception as e:
        if lifeline.stopping.is_set():
            logger.debug("worker rank %d shutting down (%s)", rank, type(e).__name__)
        elif ready and isinstance(e, QueueClosed):
            # Its writer stopped on purpose before this worker's own stop reached it (on a follower node, node
            # 0's close through the relay can come first): the executor hears the exit and the stop's cause.
            logger.warning("worker rank %d: %s, before this worker was told to stop; leaving", rank, e)
            code = 1
        else:
            err = RemoteError.of(rank, e)
            # A start-up failure delivered to the parent is reported there, once for the node (not once per
            # worker); only one that could not be delivered is logged here.
            shown = "" if getattr(e, "says_all", False) else err.traceback  # (a join's timeout is not a bug)
            told = not ready and _send(status, StartupFailed(rank, err.error_type, err.message, shown))
            (logger.debug if told else logger.error)(
                "worker rank %d %s: %s: %s\n%s",
                rank,
                "failed" if ready else "failed to start",
                err.error_type,
                err.message,
                err.traceback,
            )
            code = 1
    finally:
        exiting.set()
        lifeline.main_done.set()
        if status is not None:
            status.close()
        if lifeline.death_pipe is not None:
            lifeline.death_pipe.close()
        try:
            if worker is not None:
                worker.shutdown()
            else:
                destroy_distributed()
        except Exception:  # noqa: BLE001 - exiting anyway; say what went wrong
            logger.exception("worker rank %d: error while shutting down", rank)
        lifeline.remove_orphans()
    # The worker is shut down (`worker.shutdown()` released what the engine took; queues and groups are closed):
    # leave without the interpreter's teardown, during which the staged close would think SIGTERM was ignored.
    exit_now(code, run_atexit=not forked)


def _import_main(how: str, where: str) -> None:
    """What spawn's preparation would have done (workers.py moved it here): import the engine's main module as
    `__mp_main__`, flagged as multiprocessing flags it (`refuse_reimported_main` and multiprocessing's own
    check read the flag)."""
    import multiprocessing.process
    import multiprocessing.spawn as spawn

    this = multiprocessing.process.current_process()
    this._inheriting = True  # type: ignore[attr-defined]
    try:
        if how == "init_main_from_name":
            spawn._fixup_main_from_name(where)  # type: ignore[attr-defined]
        else:
            spawn._fixup_main_from_path(where)  # type: ignore[attr-defined]
    finally:
        del this._inheriting  # type: ignore[attr-defined]


def refuse_reimported_main(what: str) -> None:
    """In a spawned worker that is still re-importing the engine's main module (multiprocessing's spawn runs it
    again, as `__mp_main__`), an executor being built means the module starts one at import: without an
    `if __name__ == "__main__":` guard every worker would start a cluster of its own. Say so on stderr and
    leave with EXIT_REIMPORTED_MAIN, which the parent turns into the same sentence."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):  # (spawn's own flag for this phase)
        return
    main = sys.modules.get("__mp_main__")
    path = getattr(main, "__file__", None) or "the engine's main module"
    print(
        f"rayfree: this worker process re-ran {path}, which builds a {what} when it is imported: the workers "
        f"start with 'spawn', which imports the engine's main module again in each of them; put the engine's "
        f'start under `if __name__ == "__main__":`',
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EXIT_REIMPORTED_MAIN)


class WorkerArgumentsError(RuntimeError):
    """The worker's arguments did not unpickle in its process (a module only the parent has, say)."""


def _set_launcher_environment(kwargs: dict[str, Any]) -> None:
    """The torchrun-compatible variables for the world this rank joins, before any engine code runs, so that
    libraries that read them (transformers' tp_plan, accelerate, torch's DeviceMesh helpers) see the truth."""
    config = kwargs.get("config")
    if config is None:
        return
    from rayfree.cluster.environment import launcher_environment

    os.environ.update(
        launcher_environment(config.parallel, kwargs["rank"], kwargs["local_rank"], kwargs["distributed_init_method"])
    )


def _send(pipe: Connection | None, msg: Any) -> bool:
    """Did `msg` reach the parent's end of the status pipe?"""
    if pipe is None:
        return False
    try:
        pipe.send_bytes(encode(msg))
    except OSError:
        return False
    return True
