"""`WorkerProc`: what runs in one rank's process — start-up, the READY handshake, the busy loop, the exits.

The parent side (spawning, the ready wait, the staged close) is
`rayfree.executor.workers.WorkerGroup`. Here, `worker_main` builds the worker (device, model, queues), reports
READY, completes the queue handshake, then serves RPCs from the broadcast
queue until told to stop. Start-up failures are reported to the parent with
their traceback; run-time failures become RemoteError replies; a parent that dies
makes the child shut its queues and exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from rayfree import logs
from rayfree.cluster.config import ClusterConfig
from rayfree.imports import load_object
from rayfree.transport import Handle, MessageQueue, TransportError, security

from .messages import Boxed, Ready, RemoteError, StartupFailed, encode

__all__ = ["WorkerProc", "resolve_worker_cls", "worker_info"]

logger = logging.getLogger("rayfree.worker")

#: Reply queues: 8 chunks of 4 MiB each (bigger replies still fit: they span chunks or overflow).
REPLY_CHUNK_BYTES = 4 << 20
REPLY_CHUNKS = 8


def resolve_worker_cls(worker_cls: type | str | bytes) -> type:
    """A class, a 'pkg.mod:Class' path, or a cloudpickled class."""
    if isinstance(worker_cls, bytes):
        return cloudpickle.loads(worker_cls)
    if isinstance(worker_cls, str):
        worker_cls = load_object(worker_cls, "worker class")
    if not isinstance(worker_cls, type):
        raise TypeError(f"worker class must be a class or 'pkg.mod:Class', got {worker_cls!r}")
    return worker_cls


def _process_name(dims: list[tuple[str, int, int]]) -> str:
    """Worker_PP1_TP0: only the dimensions larger than 1."""
    return "Worker" + "".join(f"_{tag}{rank}" for tag, size, rank in dims if size > 1)


def setup_proc_title_and_log_prefix(enable_ep: bool = False) -> str:
    """Title this process (ps/top) and its log lines after its place in the parallel layout."""
    import sys
    ps = sys.modules.get("rayfree.cluster.parallel_state")  # not imported: no groups (and no torch import here)
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
                raise RuntimeError(f"worker rank {self.rank}: single-node worker started without the broadcast queue's handle")
            self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, self.rank)
            self.worker_response_mq = MessageQueue(1, 1, max_chunk_bytes=REPLY_CHUNK_BYTES, max_chunks=REPLY_CHUNKS)
            return
        from rayfree.cluster.parallel_state import get_inner_dp_world_group
        group = get_inner_dp_world_group()
        # Rank 0 (on the leader node) holds the executor's handle and relays it.
        self.rpc_broadcast_mq = group.create_mq_broadcaster(
            external_writer_handle=input_shm_handle if group.rank_in_group == 0 else None, blocking=False)
        self.worker_response_mq, self.peer_response_handles = group.create_single_reader_mq_broadcasters(
            reader_rank_in_group=0, max_chunk_bytes=REPLY_CHUNK_BYTES, max_chunks=REPLY_CHUNKS)

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
        security.use(kwargs.pop("security_policy", None))
        ready_writer: Connection | None = kwargs.pop("ready_pipe")
        death_pipe: Connection | None = kwargs.pop("death_pipe", None)
        for fd in kwargs.pop("inherited_fds", []):
            try:
                os.close(fd)
            except OSError as e:
                logger.warning("closing an inherited pipe: %s", e)
        logs.configure()
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

    def enqueue_output(self, output: Any) -> None:
        """`output` is already a reply (a Boxed value where it must be, see messages.Boxed)."""
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
    from rayfree.transport import get_ip
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
    ps = sys.modules.get("rayfree.cluster.parallel_state")
    if ps is not None:
        ps.destroy_distributed_environment()


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else "<callable>"

