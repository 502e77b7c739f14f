"""`WorkerProc`: one rank's process — start-up, the READY handshake, the busy loop, the exits.

Parent side (called by the executor): `make_worker_process` starts a child
with two one-way pipes — *ready* (child -> parent: a msgspec `Ready` or
`StartupFailed`) and *death* (parent -> child: never written; EOF means the
parent is gone) — and `wait_for_ready` waits on all ready pipes and process
sentinels at once.

Child side: `worker_main` builds the worker (device, model, queues), reports
READY, completes the queue handshake, then serves RPCs from the broadcast
queue until told to stop. Start-up failures are reported to the parent with
their traceback; run-time failures become RemoteError replies; a parent that dies
makes the child shut its queues and exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle

from cluster.config import ClusterConfig
from transport import Handle, MessageQueue, TransportError

from .messages import Boxed, Ready, RemoteError, StartupFailed, box, decode, encode

__all__ = ["WorkerProc", "UnreadyWorkerProcHandle", "WorkerProcHandle", "WorkerStartupError", "resolve_worker_cls",
           "exit_description", "worker_info"]

logger = logging.getLogger("rayfree.worker")

#: Reply queues: 8 chunks of 4 MiB each (bigger replies still fit: they span chunks or overflow).
REPLY_CHUNK_BYTES = 4 << 20
REPLY_CHUNKS = 8


class WorkerStartupError(RuntimeError):
    """A worker could not start: it raised, died, or never became ready."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message + (f"\n\nWorker traceback:\n{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback


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


def resolve_worker_cls(worker_cls: type | str | bytes) -> type:
    """A class, a 'pkg.mod:Class' path, or a cloudpickled class."""
    if isinstance(worker_cls, bytes):
        return cloudpickle.loads(worker_cls)
    if isinstance(worker_cls, str):
        mod, sep, name = worker_cls.partition(":")
        if not sep or not mod or not name:
            raise ValueError(f"worker class {worker_cls!r}: write it as 'package.module:ClassName'")
        import importlib
        try:
            obj: Any = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"worker class {worker_cls!r}: cannot import {mod!r}: {e}") from e
        for part in name.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ValueError(f"worker class {worker_cls!r}: {mod!r} has no {part!r}") from None
        worker_cls = obj
    if not isinstance(worker_cls, type):
        raise TypeError(f"worker class must be a class or 'pkg.mod:Class', got {worker_cls!r}")
    return worker_cls


@dataclass
class UnreadyWorkerProcHandle:
    """A started worker that has not reported READY yet."""

    proc: BaseProcess
    rank: int
    ready_pipe: Connection
    death_writer: Connection | None = None


@dataclass
class WorkerProcHandle:
    """A ready worker: its process, its reply queue and (worker 0, multi-node) the remote ranks' queues."""

    proc: BaseProcess
    rank: int
    worker_response_mq: MessageQueue | None
    peer_worker_response_mqs: list[MessageQueue | None] = field(default_factory=list)
    death_writer: Connection | None = None


def _process_name(dims: list[tuple[str, int, int]]) -> str:
    """Worker_PP1_TP0: only the dimensions larger than 1."""
    return "Worker" + "".join(f"_{tag}{rank}" for tag, size, rank in dims if size > 1)


def setup_proc_title_and_log_prefix(enable_ep: bool = False) -> str:
    """Title this process (ps/top) and its log lines after its place in the parallel layout."""
    import sys
    ps = sys.modules.get("cluster.parallel_state")  # not imported: no groups (and no torch import here)
    name = "Worker"
    if ps is not None and ps.model_parallel_is_initialized():
        dims = [("DP", ps.get_dp_group()), ("PP", ps.get_pp_group()), ("PCP", ps.get_pcp_group()),
                ("TP", ps.get_tp_group()), ("DCP", ps.get_dcp_group())]
        if enable_ep:
            dims.append(("EP", ps.get_ep_group()))
        name = _process_name([(tag, g.world_size, g.rank_in_group) for tag, g in dims])
    try:
        import setproctitle
        setproctitle.setproctitle(f"rayfree::{name}")
    except ImportError:  # pragma: no cover - it is a dependency
        pass
    multiprocessing.current_process().name = name  # %(processName)s in every log line
    return name


class WorkerProc:
    """Runs one worker in this (child) process."""

    def __init__(self, config: ClusterConfig, worker_cls: type | str | bytes, worker_kwargs: dict[str, Any],
                 local_rank: int, rank: int, distributed_init_method: str, input_shm_handle: bytes | None,
                 is_driver_worker: bool) -> None:
        self.config = config
        self.rank = rank
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.worker_response_mq: MessageQueue | None = None
        self.peer_response_handles: list[Handle] = []
        self.async_output_queue: queue.Queue | None = None
        cls = resolve_worker_cls(worker_cls)
        self.worker = cls(config, local_rank, rank, distributed_init_method, is_driver_worker, **worker_kwargs)
        setup_proc_title_and_log_prefix()
        self.worker.init_device()
        setup_proc_title_and_log_prefix(config.parallel.enable_expert_parallel)
        self.worker.load_model()
        if config.async_scheduling:
            self.async_output_queue = queue.Queue()
            threading.Thread(target=self.async_output_busy_loop, daemon=True, name="WorkerAsyncOutput").start()
        self._init_message_queues(input_shm_handle)
        global _this
        _this = self

    def _init_message_queues(self, input_shm_handle: bytes | None) -> None:
        if self.config.parallel.nnodes_within_dp == 1:
            if input_shm_handle is None:
                raise WorkerStartupError("single-node worker started without the broadcast queue's handle", self.rank)
            self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, self.rank)
            self.worker_response_mq = MessageQueue(1, 1, max_chunk_bytes=REPLY_CHUNK_BYTES, max_chunks=REPLY_CHUNKS)
            return
        from cluster.parallel_state import get_inner_dp_world_group
        group = get_inner_dp_world_group()
        # Rank 0 (on the leader node) holds the executor's handle and relays it.
        self.rpc_broadcast_mq = group.create_mq_broadcaster(
            external_writer_handle=input_shm_handle if group.rank_in_group == 0 else None, blocking=False)
        self.worker_response_mq, self.peer_response_handles = group.create_single_reader_mq_broadcasters(
            reader_rank_in_group=0, max_chunk_bytes=REPLY_CHUNK_BYTES, max_chunks=REPLY_CHUNKS)

    # -- parent side ---------------------------------------------------------------

    @staticmethod
    def make_worker_process(context: Any, config: ClusterConfig, worker_cls: type | str | bytes,
                            worker_kwargs: dict[str, Any], local_rank: int, rank: int,
                            distributed_init_method: str, input_shm_handle: bytes | None, is_driver_worker: bool,
                            inherited_fds: list[int] | None = None) -> UnreadyWorkerProcHandle:
        """Start one worker process; the child's pipe ends are closed here, in the parent."""
        ready_reader, ready_writer = context.Pipe(duplex=False)
        death_reader, death_writer = context.Pipe(duplex=False)
        if inherited_fds is not None:  # fork: the child closes the parent ends of earlier workers' pipes
            inherited_fds = [*inherited_fds, ready_reader.fileno(), death_writer.fileno()]
        kwargs = dict(config=config, worker_cls=worker_cls, worker_kwargs=worker_kwargs, local_rank=local_rank,
                      rank=rank, distributed_init_method=distributed_init_method,
                      input_shm_handle=input_shm_handle, is_driver_worker=is_driver_worker,
                      ready_pipe=ready_writer, death_pipe=death_reader, inherited_fds=inherited_fds or [])
        proc = context.Process(target=WorkerProc.worker_main, kwargs=kwargs, name=f"RayfreeWorker-{rank}",
                               daemon=True)
        try:
            proc.start()
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            for c in (ready_reader, ready_writer, death_reader, death_writer):
                c.close()
            raise WorkerStartupError(f"cannot start worker rank {rank}: its arguments must be picklable "
                                     f"(worker_kwargs, worker class): {e}", rank) from e
        finally:
            ready_writer.close()
            death_reader.close()
        return UnreadyWorkerProcHandle(proc, rank, ready_reader, death_writer)

    @staticmethod
    def wait_for_ready(unready: list[UnreadyWorkerProcHandle], timeout: float | None = None,
                       is_local_rank=lambda rank: True, attach: bool = True) -> list[WorkerProcHandle]:
        """Wait for every worker's READY; raise WorkerStartupError naming whoever failed or was late.

        Waits on the ready pipes and the process sentinels together, so a worker
        that dies before READY is reported at once, with its exit code.
        `attach=False` (a follower node): do not attach to the workers' reply
        queues. Their one reader is the leader; a second subscriber could take
        the queue's READY in its place.
        """
        pending = {h.ready_pipe: h for h in unready}
        by_sentinel = {h.proc.sentinel: h for h in unready}
        done: dict[int, WorkerProcHandle] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            WorkerProc._wait_all(pending, by_sentinel, done, deadline, timeout, is_local_rank, attach)
        except BaseException:
            for w in done.values():  # queues already attached to ready workers
                for mq in (w.worker_response_mq, *w.peer_worker_response_mqs):
                    if mq is not None:
                        mq.close()
            for pipe in pending:
                pipe.close()
            raise
        return [done[h.rank] for h in unready]

    @staticmethod
    def _wait_all(pending, by_sentinel, done, deadline, timeout, is_local_rank, attach) -> None:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            waiting_on = list(pending) + [s for s, h in by_sentinel.items() if h.ready_pipe in pending]
            ready = multiprocessing.connection.wait(waiting_on, timeout=left)
            if not ready:
                late = sorted(h.rank for h in pending.values())
                raise WorkerStartupError(f"worker rank(s) {late} did not become ready within {timeout:.0f}s "
                                         f"(ready_timeout_s); they may be stuck loading the model or joining "
                                         f"the world")
            for obj in ready:
                if isinstance(obj, int):  # a sentinel: that process exited
                    h = by_sentinel[obj]
                    if h.ready_pipe not in pending or h.ready_pipe.poll(0):
                        continue  # its message (if any) is read through the pipe
                    h.proc.join(1)
                    pending.pop(h.ready_pipe).ready_pipe.close()
                    raise WorkerStartupError(f"worker rank {h.rank} died before becoming ready "
                                             f"({exit_description(h.proc.exitcode)})", h.rank)
                h = pending.pop(obj)
                try:
                    msg = decode(obj.recv_bytes())
                except EOFError:
                    h.proc.join(1)
                    raise WorkerStartupError(f"worker rank {h.rank} died before becoming ready "
                                             f"({exit_description(h.proc.exitcode)})", h.rank) from None
                finally:
                    obj.close()
                if isinstance(msg, StartupFailed):
                    raise WorkerStartupError(f"worker rank {msg.rank} failed to start: {msg.error_type}: "
                                             f"{msg.message}", msg.rank, msg.traceback)
                done[h.rank] = (WorkerProc._attach(msg, h, is_local_rank) if attach
                                else WorkerProcHandle(h.proc, h.rank, None, [], h.death_writer))

    @staticmethod
    def _attach(msg: Ready, h: UnreadyWorkerProcHandle, is_local_rank) -> WorkerProcHandle:
        mq = MessageQueue.create_from_handle(msg.response_handle, 0)
        peers: list[MessageQueue | None] = [
            None if is_local_rank(rank) else MessageQueue.create_from_handle(raw, 0)
            for rank, raw in enumerate(msg.peer_response_handles)]
        return WorkerProcHandle(h.proc, h.rank, mq, peers, h.death_writer)

    # -- child side ---------------------------------------------------------------------

    def monitor_death_pipe(self, death_pipe: Connection | None, shutdown_requested: threading.Event) -> None:
        """A thread that waits for EOF on the death pipe: the parent is gone, stop serving."""
        if death_pipe is None:
            return
        queues = [self.rpc_broadcast_mq, self.worker_response_mq]

        def watch() -> None:
            try:
                death_pipe.recv_bytes()
            except EOFError:
                logger.debug("the executor closed its end of the death pipe (shutdown, or it died): stopping")
            except OSError:
                return  # closed by our own shutdown
            shutdown_requested.set()
            for mq in queues:
                if mq is not None:
                    mq.shutdown()

        threading.Thread(target=watch, daemon=True, name="DeathPipeMonitor").start()

    @staticmethod
    def worker_main(**kwargs: Any) -> None:
        """Entry point of the worker process."""
        shutdown_requested = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            if not shutdown_requested.is_set():
                shutdown_requested.set()
                raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        ready_writer: Connection | None = kwargs.pop("ready_pipe")
        death_pipe: Connection | None = kwargs.pop("death_pipe", None)
        for fd in kwargs.pop("inherited_fds", []):
            try:
                os.close(fd)
            except OSError as e:
                logger.warning("closing an inherited pipe: %s", e)
        _configure_logging()
        import faulthandler
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
        rank = kwargs.get("rank", -1)
        worker: WorkerProc | None = None
        failed = False
        try:
            worker = WorkerProc(**kwargs)
            worker.monitor_death_pipe(death_pipe, shutdown_requested)
            assert ready_writer is not None and worker.worker_response_mq is not None
            ready_writer.send_bytes(encode(Ready(
                rank, worker.worker_response_mq.export_handle().to_bytes(),
                [h.to_bytes() for h in worker.peer_response_handles])))
            timeout = kwargs["config"].ready_timeout_s
            if worker.rpc_broadcast_mq is not None:
                worker.rpc_broadcast_mq.wait_until_ready(timeout=timeout)
            worker.worker_response_mq.wait_until_ready(timeout=timeout)
            ready_writer.close()
            ready_writer = None
            worker.worker_busy_loop()
        except Exception as e:
            if ready_writer is not None and not shutdown_requested.is_set():
                logger.exception("worker rank %d failed to start", rank)
                try:
                    ready_writer.send_bytes(encode(StartupFailed(rank, type(e).__name__, str(e),
                                                                 traceback.format_exc())))
                except OSError:
                    pass
                failed = True
            elif shutdown_requested.is_set():
                logger.debug("worker rank %d shutting down", rank)
            else:
                logger.exception("worker rank %d failed", rank)
                failed = True
            shutdown_requested.set()
        except SystemExit:
            logger.warning("worker rank %d was terminated", rank)
            raise
        finally:
            if ready_writer is not None:
                ready_writer.close()
            if death_pipe is not None:
                death_pipe.close()
            try:
                if worker is not None:
                    worker.shutdown()
                else:
                    _destroy_distributed()
            except Exception:  # noqa: BLE001 - exiting anyway; say what went wrong
                logger.exception("worker rank %d: error while shutting down", rank)
        if failed:
            raise SystemExit(1)

    def worker_busy_loop(self) -> None:
        """Serve RPCs: (method, args, kwargs, output_rank) in; the result (or a RemoteError) out.

        The engine's step comes through here at every token, so the loop keeps
        to locals and pays for nothing the common case does not need.
        """
        mq = self.rpc_broadcast_mq
        assert mq is not None
        dequeue = mq.dequeue
        rank = self.rank
        worker = self.worker
        put = self.async_output_queue.put if self.async_output_queue is not None else None
        assert self.worker_response_mq is not None
        send = self.worker_response_mq.enqueue
        while True:
            method, args, kwargs, output_rank = dequeue(indefinite=True)
            try:
                if type(method) is str:
                    func = getattr(worker, method)
                elif type(method) is bytes:
                    func = partial(cloudpickle.loads(method), worker)
                else:
                    raise TypeError(f"an RPC method is a name or a pickled callable, got {type(method).__name__}")
                output = func(*args, **kwargs) if kwargs else func(*args)
            except Exception as e:
                logger.exception("worker rank %d: RPC %s raised", rank, _method_name(method))
                if output_rank is None or rank == output_rank:
                    output = RemoteError(rank, type(e).__name__, str(e), traceback.format_exc())
                    if put is not None:
                        put(output)
                    else:
                        send(output)
                continue
            if output_rank is None or rank == output_rank:
                t = type(output)
                if t is RemoteError or t is Boxed:
                    output = Boxed(output)
                if put is not None:
                    put(output)
                else:
                    try:
                        send(output)
                    except TransportError:
                        raise
                    except Exception as e:
                        self._send_unsendable(output, e)
            # Free this call's objects now, while the caller reads the reply, not when the next call arrives.
            method = args = kwargs = func = output = None

    def handle_output(self, output: Any) -> None:
        """Send one reply (through the async-output thread when async scheduling is on)."""
        if self.async_output_queue is not None:
            self.async_output_queue.put(box(output))
        else:
            self.enqueue_output(box(output))

    def enqueue_output(self, output: Any) -> None:
        """`output` is already a reply (see messages.box)."""
        mq = self.worker_response_mq
        if mq is None:
            return
        try:
            mq.enqueue(output)
        except TransportError:
            raise
        except Exception as e:
            self._send_unsendable(output, e)

    def _send_unsendable(self, output: Any, e: Exception) -> None:
        """The result itself cannot be sent (say, unpicklable): tell the caller instead of leaving it waiting."""
        logger.exception("worker rank %d: cannot send a result of type %s", self.rank, type(output).__name__)
        assert self.worker_response_mq is not None
        self.worker_response_mq.enqueue(RemoteError(self.rank, type(e).__name__,
                                                    f"the result ({type(output).__name__}) could not be sent: {e}",
                                                    traceback.format_exc()))

    def async_output_busy_loop(self) -> None:
        """Send outputs from a thread so the busy loop can start the next step at once."""
        q = self.async_output_queue
        assert q is not None
        while True:
            output = q.get()
            if output is _STOP:
                return
            try:
                self.enqueue_output(output)
            except TransportError:
                return

    def shutdown(self) -> None:
        if self.async_output_queue is not None:
            self.async_output_queue.put(_STOP)
        for mq in (self.rpc_broadcast_mq, self.worker_response_mq):
            if mq is not None:
                mq.close(flush_timeout=0)  # the executor is stopping too: it reads no more replies
        self.rpc_broadcast_mq = self.worker_response_mq = None
        try:
            self.worker.shutdown()
        finally:
            _destroy_distributed()


_STOP = object()
#: The WorkerProc of this process (set once it is built), for `worker_info`.
_this: WorkerProc | None = None


def worker_info(_worker: Any = None) -> dict[str, Any]:
    """Where this rank runs and how its queues travel; `collective_rpc(worker_info)` gives the topology."""
    import socket
    from transport import get_ip
    wp = _this
    par = wp.config.parallel if wp is not None else None

    def path(mq: MessageQueue | None, writer_side: bool) -> str:
        if mq is None:
            return "-"
        if writer_side:
            return "shm" if mq.n_local_reader else "tcp"
        return "shm" if mq.is_local_reader else "tcp"

    return {
        "rank": wp.rank if wp is not None else -1,
        "node": par.node_of(wp.rank) if par is not None and wp is not None else 0,
        "host": socket.gethostname(),
        "ip": get_ip(peer=par.master_addr if par is not None and par.nnodes > 1 else None),
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "broadcast": path(wp.rpc_broadcast_mq if wp else None, False),
        "replies": path(wp.worker_response_mq if wp else None, True),
    }


def _destroy_distributed() -> None:
    import sys
    ps = sys.modules.get("cluster.parallel_state")
    if ps is not None:
        ps.destroy_distributed_environment()


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else "<callable>"


def _configure_logging() -> None:
    """Worker processes log with their place in the layout (Worker_PP1_TP0) and pid."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=os.environ.get("RAYFREE_LOG_LEVEL", "INFO"),
                            format="(%(processName)s pid=%(process)d) %(levelname)s %(name)s: %(message)s")
