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
from rayfree.transport import MessageQueue
from rayfree.transport.secure import policy as security
from rayfree.transport.shm.segment import remove_entries_of

from .messages import Fatal, Ready, RemoteError, StartupFailed, encode
from .proc import FatalRpc, WorkerProc, destroy_distributed

__all__ = ["worker_main", "Lifeline", "EXIT_FATAL", "EXIT_ORPHANED"]

logger = logging.getLogger("rayfree.worker")

#: exit codes the parent can tell apart
EXIT_FATAL = 1  # a collective step raised (its Fatal is on the status pipe)
EXIT_ORPHANED = 3  # the parent died
#: how long a worker whose parent died lets the running method unwind before it leaves anyway
LIFELINE_GRACE_S = 0.5


class Lifeline:
    """Watches the death pipe from the first moment (before the model loads) and knows every queue made since."""

    def __init__(self, death_pipe: Connection | None) -> None:
        self.death_pipe = death_pipe
        # The pid multiprocessing recorded when it spawned us, not getppid(): a parent that died while this
        # process was still importing would otherwise be taken for init, and its death for a shutdown.
        parent = multiprocessing.parent_process()
        self.parent = parent.pid if parent is not None and parent.pid else os.getppid()
        self.stopping = threading.Event()  # the parent is gone or shutting down: do not report failures
        self.parent_died = False
        self.exiting = threading.Event()  # this process is on its way out: signals no longer interrupt
        self.main_done = threading.Event()
        self.queues: list[MessageQueue] = []
        #: the worker's `leftovers()`, if it has one: paths its engine made that only its own clean shutdown
        #: removes (vLLM's CPU collectives' shared memory); removed too when the parent died
        self.leftovers: Callable[[], list[str]] | None = None
        if death_pipe is not None:
            threading.Thread(target=self._watch, daemon=True, name="RayfreeLifeline").start()

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
        self.stopping.set()
        for mq in list(self.queues):
            mq.shutdown()  # a busy loop waiting for the next call returns
        # EOF comes both from a shutdown and from the parent's death; the kernel closes a dying process's
        # files before it hands its children to a new parent, so keep looking until this process is done.
        while os.getppid() == self.parent:
            if self.main_done.wait(0.05):
                return
        self.parent_died = True
        logger.warning("the executor (pid %d) died: stopping now", self.parent)
        if not self.main_done.is_set():
            _thread.interrupt_main()  # a running method unwinds at its next Python step
        if self.main_done.wait(LIFELINE_GRACE_S):
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


def worker_main(**kwargs: Any) -> None:
    """Entry point of the worker process (the parent's WorkerGroup passes these keyword arguments)."""
    security.use(kwargs.pop("security_policy", None))
    status: Connection | None = kwargs.pop("ready_pipe")
    lifeline = Lifeline(kwargs.pop("death_pipe", None))

    def on_signal(signum: int, frame: Any) -> None:
        # The staged close's SIGTERM must stop a busy worker; only the exit path itself is left alone.
        if not lifeline.exiting.is_set():
            lifeline.exiting.set()
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for fd in kwargs.pop("inherited_fds", []):
        try:
            os.close(fd)
        except OSError as e:
            logger.warning("closing an inherited pipe: %s", e)
    logs.configure()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    rank = kwargs.get("rank", -1)
    worker: WorkerProc | None = None
    code = 0
    ready = False
    try:
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
        else:
            err = RemoteError.of(rank, e)
            # A start-up failure delivered to the parent is reported there, once for the node (not once per
            # worker); only one that could not be delivered is logged here.
            told = not ready and _send(status, StartupFailed(rank, err.error_type, err.message, err.traceback))
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
        lifeline.exiting.set()
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
    if code:
        sys.exit(code)


def _send(pipe: Connection | None, msg: Any) -> bool:
    """Did `msg` reach the parent's end of the status pipe?"""
    if pipe is None:
        return False
    try:
        pipe.send_bytes(encode(msg))
    except OSError:
        return False
    return True
