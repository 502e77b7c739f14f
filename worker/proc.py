"""`WorkerProc`: what runs in one rank's process once it is started — the worker, its queues, the busy loop.

The process's entry point, its signals and its watch on the parent are
worker/main.py; the parent side (spawning, the ready wait, the staged close)
is `rayfree.executor.workers.WorkerGroup`. A run-time failure becomes a
RemoteError reply; one in a collective step (`collective_methods`) is fatal:
the worker says so on its status pipe and leaves, since its peers may be
blocked in a collective with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
from functools import partial
from typing import Any

import cloudpickle

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.peers import peer_gone
from rayfree.imports import SpecError, check_spec, load_object
from rayfree.supervisor import supervisor
from rayfree.transport import Handle, MessageQueue, TransportError

from .messages import Boxed, RemoteError
from .titles import set_title, title_for

__all__ = ["WorkerProc", "FatalRpc", "resolve_worker_cls", "check_worker_path", "worker_info", "destroy_distributed"]

logger = logging.getLogger("rayfree.worker")

#: Reply queues: 8 chunks of 4 MiB each (bigger replies still fit: they span chunks or overflow).
REPLY_CHUNK_BYTES = 4 << 20
REPLY_CHUNKS = 8


class FatalRpc(Exception):
    """A collective step raised: the busy loop ends and the process leaves (worker/main.py)."""

    def __init__(self, method: str, error: RemoteError) -> None:
        super().__init__(f"{method} raised {error.error_type}: {error.message}")
        self.method = method
        self.error = error


def resolve_worker_cls(worker_cls: type | str | bytes) -> type:
    """A class, a 'pkg.mod:Class' path, or a cloudpickled class."""
    if isinstance(worker_cls, bytes):
        return cloudpickle.loads(worker_cls)
    if isinstance(worker_cls, str):
        worker_cls = load_object(worker_cls, "worker class")
    if not isinstance(worker_cls, type):
        raise TypeError(f"worker class must be a class or 'pkg.mod:Class', got {worker_cls!r}")
    return worker_cls


def check_worker_path(spec: str) -> None:
    """Refuse a worker class path that is wrong here, before any worker is spawned (ConfigError).

    Only a definite answer counts: the path's form, or its module importing here without the name (or with
    something that is not a class). A module this process cannot import at all (it exists only where the
    workers run) is left to the workers."""
    from rayfree.cluster.config import ConfigError

    try:
        if check_spec(spec, "worker class"):
            return  # read from its source: its module (and torch with it) is imported where the workers run
        resolve_worker_cls(spec)
    except (SpecError, TypeError) as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:  # its module does not import here
        logger.debug("worker class %s: not importable here (%s); the workers resolve it", spec, e)


def declared_runs_on(worker_cls: type | str) -> str | None:
    """What a worker class declares it runs on (`WorkerBase.runs_on`: "cpu", "cuda"), seen without importing
    its module where the workers are not: the class itself, its module if already imported, or the literal
    its class body assigns (class_literal); None: it declares nothing (or only where it is imported)."""
    import sys

    from rayfree.imports import SpecError, class_literal, split_spec

    if not isinstance(worker_cls, str):
        value = getattr(worker_cls, "runs_on", None)
    else:
        try:
            mod, name = split_spec(worker_cls, "worker class")
        except SpecError:
            return None  # (check_worker_path says what is wrong with it)
        loaded = sys.modules.get(mod)
        cls = getattr(loaded, name, None) if loaded is not None else None
        value = getattr(cls, "runs_on", None) if cls is not None else class_literal(worker_cls, "runs_on")
    return value if isinstance(value, str) else None


class WorkerProc:
    """Runs one worker in this (child) process. `lifeline.watch(mq)` learns of every queue it makes."""

    def __init__(
        self,
        config: ClusterConfig,
        worker_cls: type | str | bytes,
        worker_kwargs: dict[str, Any],
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: bytes | None,
        is_driver_worker: bool,
        lifeline: Any = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.collective = frozenset(config.collective_methods)
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.worker_response_mq: MessageQueue | None = None
        self.peer_response_handles: list[Handle] = []
        #: a follower node's first worker, broadcast by relay: (the leader's handle, where its node's relay subscribes)
        self.upstream: tuple[bytes, str] | None = None
        self.local_rank = local_rank
        self.async_output_queue: queue.Queue | None = None
        self._lifeline = lifeline
        self._finish: Any = None
        cls = resolve_worker_cls(worker_cls)
        self.worker = cls(config, local_rank, rank, distributed_init_method, is_driver_worker, **worker_kwargs)
        if lifeline is not None:
            lifeline.leftovers = getattr(self.worker, "leftovers", None)
        set_title()
        self.worker.init_device()
        par = config.parallel
        set_title(par.enable_expert_parallel, title_for(par, rank), (par.data_parallel_size, par.dp_rank))
        self.worker.load_model()
        if config.async_scheduling:
            self.async_output_queue = queue.Queue()  # (its sender thread starts with the busy loop, once wired)
        self._init_message_queues(input_shm_handle)
        #: `worker.finish_output(output)`, if the worker has one: what is sent in place of an output that is
        #: not ready to send yet (vLLM's asynchronous outputs, still being copied off the device). With
        #: async_scheduling it runs in the sender thread, so the next step starts at once.
        self._finish = getattr(self.worker, "finish_output", None)
        global _this
        _this = self

    def _init_message_queues(self, input_shm_handle: bytes | None) -> None:
        if self.config.parallel.nnodes_within_dp == 1:
            if input_shm_handle is None:
                raise RuntimeError(
                    f"worker rank {self.rank}: a one-node worker started without the broadcast queue's handle"
                )
            self.rpc_broadcast_mq = self._watched(
                MessageQueue.create_from_handle(
                    input_shm_handle, self.rank, spin_us=self.config.spin_us, zero_copy=self.config.shared_arguments
                )
            )
            local = 0 if self.config.force_remote else 1
            self.worker_response_mq = self._watched(
                MessageQueue(
                    1,
                    local,
                    max_chunk_bytes=REPLY_CHUNK_BYTES,
                    max_chunks=REPLY_CHUNKS,
                    connect_ip="127.0.0.1",
                    spin_us=self.config.spin_us,
                )
            )
            return
        from rayfree.cluster.parallel_state import get_inner_dp_world_group
        from rayfree.cluster.relay_tree import attach_broadcast

        group = get_inner_dp_world_group()
        mq, self.upstream = attach_broadcast(group, self.config, self.local_rank, input_shm_handle)
        self.rpc_broadcast_mq = self._watched(mq)
        mq, self.peer_response_handles = group.create_single_reader_mq_broadcasters(
            reader_rank_in_group=0,
            max_chunk_bytes=REPLY_CHUNK_BYTES,
            max_chunks=REPLY_CHUNKS,
            spin_us=self.config.spin_us,
        )
        self.worker_response_mq = self._watched(mq)

    def _watched(self, mq: MessageQueue) -> MessageQueue:
        if self._lifeline is not None:
            self._lifeline.watch(mq)
        return mq

    # -- serving ----------------------------------------------------------------------------

    def worker_busy_loop(self) -> None:
        """Serve RPCs: (method, args, kwargs, output_rank) in; the result (or a RemoteError) out.

        The engine's step comes through here at every token, so the loop keeps
        to locals and pays for nothing the common case does not need.
        """
        mq = self.rpc_broadcast_mq
        assert mq is not None and self.worker_response_mq is not None
        if self.async_output_queue is not None:
            supervisor().start("RayfreeAsyncOutput", self.async_output_busy_loop)
        dequeue = mq.dequeue
        rank = self.rank
        worker = self.worker
        put = self.async_output_queue.put if self.async_output_queue is not None else None
        send = self.worker_response_mq.enqueue
        finish = self._finished if self._finish is not None else None  # see _finish
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
                self._failed(method, output_rank, e)
                method = args = kwargs = func = None
                continue
            if output_rank is None or rank == output_rank:
                t = type(output)
                if t is RemoteError or t is Boxed:
                    output = Boxed(output)
                if put is not None:
                    put(output)
                else:
                    try:
                        send(output if finish is None else finish(output))
                    except TransportError:
                        raise
                    except Exception as e:
                        self._send_unsendable(output, e)
            # Free this call's objects now, while the caller reads the reply, not when the next call arrives.
            method = args = kwargs = func = output = None

    def _failed(self, method: Any, output_rank: int | None, e: Exception) -> None:
        """Reply with the error (if this rank replies); in a collective step, then leave (FatalRpc)."""
        name = method if isinstance(method, str) else "<callable>"
        error = RemoteError.of(self.rank, e)
        if name in self.collective and peer_gone(error.error_type, error.message, timeouts=False):
            # A peer of this collective went away: the consequence of a death the executor names, not a cause.
            logger.warning(
                "worker rank %d: %s stopped because a peer went away (%s: %s); %s",
                self.rank,
                name,
                error.error_type,
                error.message.splitlines()[0][:200] if error.message else "",
                "staying (coupled DP replicas)" if self.config.parallel.coupled else "leaving",
            )
            logger.debug("worker rank %d: %s's traceback:\n%s", self.rank, name, error.traceback)
        else:
            logger.error(
                "worker rank %d: RPC %s raised %s: %s\n%s",
                self.rank,
                name,
                error.error_type,
                error.message,
                error.traceback,
            )
        if output_rank is None or self.rank == output_rank:
            if self.async_output_queue is not None:
                self.async_output_queue.put(error)
            else:
                self.enqueue_output(error)
        if name in self.collective:
            if self.config.parallel.coupled and peer_gone(error.error_type, error.message):
                from rayfree.cluster.across_replicas import drop

                drop()  # a replica lost under a collective across replicas: this rank stays (executor/membership.py)
                return
            self.flush_outputs(5.0)
            raise FatalRpc(name, error)

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
        logger.error("worker rank %d: cannot send a result of type %s: %s", self.rank, type(output).__name__, e)
        assert self.worker_response_mq is not None
        err = RemoteError.of(self.rank, e)
        self.worker_response_mq.enqueue(
            RemoteError(
                self.rank,
                err.error_type,
                f"the result ({type(output).__name__}) could not be sent: {err.message}",
                err.traceback,
            )
        )

    def async_output_busy_loop(self) -> None:
        """Send outputs from a thread so the busy loop can start the next step at once."""
        q = self.async_output_queue
        assert q is not None
        while True:
            output = q.get()
            if output is _STOP:
                return
            if type(output) is threading.Event:  # flush_outputs: everything before it is sent
                output.set()
                continue
            try:
                self.enqueue_output(
                    output if self._finish is None or type(output) is RemoteError else self._finished(output)
                )  # a RemoteError here is a failed call
            except TransportError:
                return

    def _finished(self, output: Any) -> Any:
        """`worker.finish_output(output)`; its exception becomes the reply, as the method's own would."""
        if type(output) is Boxed:  # a RemoteError the method returned as its value: nothing to finish
            return output
        try:
            return self._finish(output)
        except Exception as e:
            logger.error(
                "worker rank %d: finishing an output of type %s raised %s: %s",
                self.rank,
                type(output).__name__,
                type(e).__name__,
                e,
            )
            return RemoteError.of(self.rank, e)

    def flush_outputs(self, timeout: float) -> None:
        """Wait until the output thread has sent what it holds (before the process leaves)."""
        if self.async_output_queue is not None:
            done = threading.Event()
            self.async_output_queue.put(done)
            done.wait(timeout)

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
            destroy_distributed()


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
        if mq.is_local_reader:  # a follower node's local ring is its relay's
            return "relay" if par is not None and par.node_rank_within_dp > 0 else "shm"
        return "tcp"

    return {
        "rank": wp.rank if wp is not None else -1,
        "replica": par.dp_rank if par is not None else 0,
        "global_rank": par.global_rank(wp.rank) if par is not None and wp is not None else -1,
        "node": par.cluster_node_of(wp.rank) if par is not None and wp is not None else 0,
        "host": socket.gethostname(),
        "ip": get_ip(peer=par.master_addr if par is not None and par.nnodes > 1 else None),
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "broadcast": path(wp.rpc_broadcast_mq if wp else None, False),
        "replies": path(wp.worker_response_mq if wp else None, True),
    }


def destroy_distributed() -> None:
    import sys

    ps = sys.modules.get("rayfree.cluster.parallel_state")
    if ps is not None:
        ps.destroy_distributed_environment()
