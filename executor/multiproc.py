"""`MultiprocExecutor`: one worker process per local rank, RPCs through the broadcast queue.

The leader (node_rank_within_dp 0) creates the broadcast queue, spawns its
local workers and reads every rank's replies; a follower node runs the same
class headless: it spawns its workers and watches them, but broadcasts
nothing. Start-up: spawn every local worker, then wait for all READYs, then
the queue handshakes in the order the workers do them (broadcast first, then
each reply queue). A monitor thread watches the worker processes: one dying
fails every pending and later call within a second, naming the rank.

Across nodes, the leader and each follower exchange heartbeats
(cluster/heartbeat.py): a follower that falls silent fails the leader's calls
within `heartbeat_timeout_s`, naming the node; a follower whose leader falls
silent (or fails) stops its workers. A clean stop on either side says goodbye
first, so the other side stops too instead of waiting for a timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import cloudpickle

from rayfree.cluster.config import ClusterConfig, ConfigError, require_config
from rayfree.transport import MessageQueue, QueueClosed, QueueShutdown, get_ip, get_open_port, security
from rayfree.transport.security import require_secret
from rayfree.worker.proc import check_worker_path
from rayfree.worker.messages import Boxed, Fatal, RemoteError

from .abstract import Executor
from .collect import Collector, map_failure, unwrap
from .errors import (ExecutorFailed, FatalWorkerError, LeaderLost, NodeLost, NotLeaderError, WorkerDied,
                     WorkerStartupError, failed_as)
from .future import FutureWrapper, WaitExpired
from .liveness import NodeLiveness
from .observe import RpcRecorder, StallWatch
from .workers import WorkerGroup, WorkerHandle, exit_description

__all__ = ["MultiprocExecutor"]

logger = logging.getLogger("rayfree.executor")

_perf = time.perf_counter


_PEER_GONE = ("connection", "peer", "broken pipe")
_TIMED_OUT = ("timed out", "timeout")


def _peer_gone(message: str, timeouts: bool = True) -> bool:
    """Does a collective's error read like its peer went away (gloo/NCCL connection errors; with `timeouts`,
    also a collective that timed out waiting for it)?"""
    m = message.lower()
    return any(s in m for s in _PEER_GONE) or (timeouts and any(s in m for s in _TIMED_OUT))


class MultiprocExecutor(Executor):
    """One worker process per rank of this node; on the leader, every call broadcast to every rank.

    Calls from several threads are serialized (send and receive together), so no thread is ever handed
    another's reply; a future's `result()` may be read from any thread.
    """

    supports_pp: bool = True

    def __init__(self, config: ClusterConfig, worker_cls: type | str, worker_kwargs: dict[str, Any] | None = None,
                 monitor_workers: bool = True, liveness: NodeLiveness | None = None, *,
                 secret: bytes | str | os.PathLike[str] | None = None) -> None:
        """Start one worker process per rank of this node and, on the leader, the queues that reach every rank.

        Returns once every worker is ready; a worker that fails or hangs at start-up is named and nothing is
        left running.

        Args:
            config: the cluster's shape and timeouts. Checked before anything starts: a wrong value is a
                `ConfigError` naming the field and the value (a dict instead of a ClusterConfig: TypeError).
            worker_cls: the worker class (a `rayfree.WorkerBase` subclass), or its import path
                ``"pkg.mod:Class"``. A path importable in this process is checked here (a wrong one is refused
                before any worker starts); one only the workers can import is resolved by them.
            worker_kwargs: keyword arguments for the worker's constructor (picklable).
            monitor_workers: watch the worker processes, so that one dying fails every call within a second;
                False leaves that to the caller.
            liveness: the node's heartbeats and failure policy, shared by the DP replicas of one node
                (`NodeReplicas` passes it); None: this executor makes its own.
            secret: the cluster secret, for a cluster of several nodes: its bytes (or a key file's text) or
                the path of its file (`rayfree keygen FILE`). It becomes this process's secret, handed to every
                worker. None: ``RAYFREE_SECRET_FILE``, else the compose secret ``/run/secrets/rayfree_secret``.
        """
        require_config(config)  # before anything below multiplies a size or builds a thread
        if secret is not None:
            security.use(security.Policy(security.secret_from(secret), security.current().insecure))
        self.monitor_workers = monitor_workers
        #: shared by the DP replicas of one node (executor/replicas.py); else this executor makes its own
        self.liveness = liveness
        self.shutting_down = False
        self._shutdown_done = threading.Event()
        #: set once the executor has shut down (vLLM's name)
        self.shutdown_event = self._shutdown_done
        self._failure_known = threading.Event()
        self._started = False
        self._rpc_lock = threading.RLock()
        self.group: WorkerGroup | None = None
        self.response_mqs: list[MessageQueue] = []
        self.rpc_broadcast_mq: MessageQueue | None = None
        self._failure: Exception | None = None
        self._stop_reason: str | None = None
        self._fast_stop = False  # a node is gone: its peers may hang in gloo, so do not wait long for them
        self._quick_stop = False  # a worker died: the same, but its local peers get a second to stop cleanly
        self._stall: StallWatch | None = None
        self.rpc_recorder = RpcRecorder(config.parallel.world_size)
        super().__init__(config, worker_cls, worker_kwargs)

    # -- start-up ------------------------------------------------------------------

    def _init_executor(self) -> None:
        self._finalizer = weakref.finalize(self, MultiprocExecutor._finalize, weakref.ref(self))
        par = self.parallel_config
        self.world_size = par.world_size
        self.local_world_size = par.local_ranks
        self.is_leader = par.node_rank_within_dp == 0
        #: this executor's DP replica (its workers' ranks are 0..world_size-1 within it)
        self.dp_rank = par.dp_rank
        multi_node = par.nnodes_within_dp > 1  # this replica spans nodes
        if par.nnodes > 1 or par.data_parallel_size > 1:  # one world for every replica
            distributed_init_method = f"tcp://{par.master_addr}:{par.master_port or 29500}"
        else:
            distributed_init_method = f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}"
        #: where the workers join torch.distributed (tcp://host:port)
        self.distributed_init_method = distributed_init_method
        worker_cls = self.worker_cls if isinstance(self.worker_cls, str) else cloudpickle.dumps(self.worker_cls)
        success = False
        try:
            if isinstance(self.worker_cls, str):
                try:
                    check_worker_path(self.worker_cls)  # one error here, not one traceback per worker
                except ConfigError as e:
                    raise WorkerStartupError(f"{e} (refused before starting any worker)") from None
            if par.nnodes > 1:
                require_secret(f"a cluster of {par.nnodes} nodes")  # before anything starts
            if self.liveness is None:
                if par.nnodes > 1 and par.replicas_per_node > 1:
                    raise ValueError(f"node {par.node_rank} runs {par.replicas_per_node} DP replicas: start them "
                                     f"together with rayfree.executor.NodeReplicas (or `rayfree node`)")
                self.liveness = NodeLiveness(self.config)
            self.liveness.attach(self)
            handle = None
            if self.is_leader:
                connect_ip = get_ip(peer=par.master_addr) if multi_node else "127.0.0.1"
                n_local = 0 if self.config.force_remote and not multi_node else self.local_world_size
                self.rpc_broadcast_mq = MessageQueue(self.world_size, n_local, list(range(n_local)),
                                                     connect_ip=connect_ip, spin_us=self.config.spin_us)
                handle = self.rpc_broadcast_mq.export_handle().to_bytes()
            start = par.global_start_rank
            self.group = WorkerGroup(self.config, worker_cls, self.worker_kwargs,
                                     list(range(start, start + self.local_world_size)), distributed_init_method,
                                     handle, attach_replies=self.is_leader)
            if self.is_failed:  # failed while spawning (another node, a replica): `_fail` found no group to wake
                self.group.abort()
            self.group.wait_ready(self.config.ready_timeout_s)
            if self.monitor_workers:
                on_death = weakref.WeakMethod(self._on_worker_death)  # the monitor must not keep us alive
                on_fatal = weakref.WeakMethod(self._on_worker_fatal)
                self.group.start_monitor(lambda w: on_death() and on_death()(w),
                                         lambda w, msg: on_fatal() and on_fatal()(w, msg))
            self.liveness.ready()
            if self.is_leader:
                self.response_mqs = self.group.response_queues(self.world_size)
                # The order the workers do it in: the broadcast queue, then the reply queues.
                self.rpc_broadcast_mq.wait_until_ready(timeout=self.config.ready_timeout_s)
                for mq in self.response_mqs:
                    mq.wait_until_ready(timeout=self.config.ready_timeout_s)
            self.futures_queue: deque[FutureWrapper] = deque()
            # Replies still owed by calls that timed out: read and dropped before newer ones.
            self._owed = [0] * self.world_size
            if self.is_leader:
                self._refresh_fast()
                self._stall = StallWatch(self, self.config.stall_report_s, self.config.stall_dump_s)
            self._started = True
            success = True
        except BaseException as e:
            self._stop_reason = f"start-up failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            lv = self.liveness
            if (self._failure is None and lv is not None and lv.verdict_s() and isinstance(e, Exception)
                    and _peer_gone(str(e), timeouts=False)):
                # A rank's rendezvous or handshake broke because another node went away: the heartbeats' verdict
                # (that node, or the leader's own failure) is the cause to report, and it comes within this window.
                lv.settled.wait(lv.verdict_s())
            failure = self._failure or (lv.failure if lv is not None and isinstance(lv.failure, (NodeLost, LeaderLost))
                                        else None)
            if failure is not None and not isinstance(e, KeyboardInterrupt):
                raise failure from e  # a node left during start-up: that, not its fallout, is the cause
            raise
        finally:
            if not success:
                self.shutdown()

    @property
    def workers(self) -> list[WorkerHandle]:
        """This node's worker processes (`.rank`, `.proc`)."""
        return self.group.workers if self.group is not None else []

    def get_response_mqs(self, unique_reply_rank: int = -1) -> list[MessageQueue]:
        """The reply queues, by rank (vLLM's accessor): every rank's (-1), or the one of `unique_reply_rank`."""
        if unique_reply_rank == -1:
            return list(self.response_mqs)
        if not isinstance(unique_reply_rank, int) or not 0 <= unique_reply_rank < len(self.response_mqs):
            raise ValueError(f"unique_reply_rank={unique_reply_rank!r} is not a rank with a reply queue here "
                             f"(0..{len(self.response_mqs) - 1}, or -1 for all)")
        return [self.response_mqs[unique_reply_rank]]

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    @property
    def failure(self) -> Exception | None:
        """Why the executor failed (None while it runs, or after a clean shutdown)."""
        return self._failure

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the executor has shut down (on request, on a failure, or when its leader stopped)."""
        return self._shutdown_done.wait(timeout)

    # -- failures --------------------------------------------------------------------------

    def _on_worker_death(self, w: WorkerHandle) -> None:
        if self.shutting_down or self.is_failed:
            return
        how = exit_description(w.proc.exitcode)
        logger.error("%s died unexpectedly (%s); shutting down the executor", w.describe(), how)
        self._quick_stop = True  # its peers may be blocked in a collective with it, deaf to the death pipe
        self._fail(WorkerDied(w.rank, how, w.proc.pid, w.title))

    def _on_worker_fatal(self, w: WorkerHandle, msg: Fatal) -> None:
        """A collective step raised on rank `w.rank`: its peers may be stuck in a collective, so stop them all."""
        if self.shutting_down or self.is_failed:
            return
        lv = self.liveness
        if lv is not None and lv.verdict_s() and _peer_gone(msg.message):
            # A rank on another node that died shows up here first, as a collective's connection error; the
            # heartbeats name that node within their suspect window, and that is the cause to report.
            logger.info("%s: %s in %s looks like a lost peer; waiting up to %.1fs for the heartbeats' verdict",
                        w.describe(), msg.error_type, msg.method, lv.verdict_s())
            lv.settled.wait(lv.verdict_s())
            if self.shutting_down or self.is_failed:
                return
        logger.error("%s raised %s in %s, a collective step: failing the executor", w.describe(), msg.error_type,
                     msg.method)
        self._fast_stop = True
        self._fail(FatalWorkerError(msg.rank, msg.error_type, msg.message, msg.traceback, msg.method,
                                    note="a collective step: the executor has stopped every worker"))

    def _fail(self, error: Exception) -> None:
        """Mark failed, wake every pending call with `error`, shut down, fire the callback once."""
        with self._callback_lock:
            if self.is_failed:
                return
            self._failure = error
            self.is_failed = True
            self._fast = False
        self._failure_known.set()
        for mq in (self.rpc_broadcast_mq, *self.response_mqs):  # blocked sends and receives return now
            if mq is not None:
                mq.shutdown()
        if self._started:
            self.shutdown()
        elif self.group is not None:
            # Start-up: the starting thread stops waiting for READY, raises this failure and shuts down (a
            # worker blocked in native code, say a rendezvous, does not hear SIGTERM: the staged close kills it).
            self._fast_stop = True
            self.group.abort()
        self._fire_failure_callback()

    # -- RPC -----------------------------------------------------------------------------

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None,
                       aggregator: Callable[[list[Any]], Any] | None = None,
                       kv_output_aggregator: Any = None, ec_output_aggregator: Any = None) -> Any:
        """See `Executor.collective_rpc`. Calls from several threads take turns (send and receive together)."""
        recv = self._fast_recv.get(unique_reply_rank) if self._fast else None
        if (recv is not None and type(method) is str and type(unique_reply_rank) is int and not non_block
                and aggregator is None and kv_output_aggregator is None and ec_output_aggregator is None):
            # The engine's step: a method name, one reply, nothing older pending.
            with self._rpc_lock:
                if not self.futures_queue and self._fast:
                    rec = self.rpc_recorder
                    rec.name, rec.rank, rec.t0 = method, unique_reply_rank, _perf()
                    end = None if timeout is None else time.monotonic() + timeout
                    try:
                        self._fast_send((method, args, kwargs, unique_reply_rank), timeout)
                    except BaseException as e:
                        rec.failed_fast()
                        raise map_failure(self, e, method, "sending it", timeout)
                    try:
                        value = recv() if end is None else recv(max(0.0, end - time.monotonic()))
                    except BaseException as e:
                        rec.failed_fast()
                        raise map_failure(self, e, method, "waiting for its replies", timeout, [unique_reply_rank])
                    rec.done_fast()
                    t = type(value)
                    if t is RemoteError or t is Boxed:
                        return unwrap(value, method, method in self.config.collective_methods)
                    return value
        connector = kv_output_aggregator if kv_output_aggregator is not None else ec_output_aggregator
        if connector is not None:
            if kv_output_aggregator is not None and ec_output_aggregator is not None:
                raise ValueError("give kv_output_aggregator or ec_output_aggregator, not both")
            reply_rank = unique_reply_rank or 0
            aggregator = lambda outputs: connector.aggregate(outputs, output_rank=reply_rank)  # noqa: E731
        with self._rpc_lock:
            return self._collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank, aggregator)

    def _collective_rpc(self, method, timeout, args, kwargs, non_block, unique_reply_rank, aggregator) -> Any:
        mq = self.rpc_broadcast_mq
        if mq is None or self.is_failed or self.shutting_down:
            if mq is None and not self.is_leader:
                raise NotLeaderError(f"this is follower node {self.parallel_config.node_rank} (node "
                                     f"{self.parallel_config.node_rank_within_dp} of its DP replica): only the "
                                     f"leader node calls collective_rpc")
            self._raise_failed()
        output_rank = None if aggregator is not None else unique_reply_rank
        if unique_reply_rank is not None and (not isinstance(unique_reply_rank, int)
                                              or not 0 <= unique_reply_rank < self.world_size):
            raise ValueError(f"unique_reply_rank={unique_reply_rank!r} is not a rank (0..{self.world_size - 1})")
        deadline = None if timeout is None else time.monotonic() + timeout
        send = method if isinstance(method, str) else cloudpickle.dumps(method)
        name = method if isinstance(method, str) else getattr(method, "__name__", "<callable>")
        ranks = list(range(self.world_size)) if output_rank is None else [output_rank]
        collect = Collector(self, name, ranks, deadline, timeout, single=output_rank is not None)  # recorded
        try:
            # While the ring is full, read the replies of older calls: the workers may wait for that room.
            mq.enqueue((send, args, kwargs, output_rank),
                       timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                       on_wait=self._drain if self.futures_queue else None)
        except (QueueShutdown, QueueClosed):
            self.rpc_recorder.end(collect.call, False)
            if self._failure is None and not self.shutting_down:
                self._failure_known.wait(1.0)  # a worker just left: the monitor names it within a second
            self._raise_failed()
        except BaseException as e:
            self.rpc_recorder.end(collect.call, False)
            raise map_failure(self, e, name, "sending it", timeout)
        if not non_block and not self.futures_queue:
            # Nothing older is pending: read the replies here, without a Future.
            value = collect(None)
            return value if aggregator is None else aggregator(value)
        fut = FutureWrapper(self.futures_queue, self._rpc_lock, collect,
                            aggregator if aggregator is not None else (lambda x: x))
        return fut if non_block else fut.result()

    def _drain(self) -> None:
        """Read the replies of pending calls that have them now (a send is waiting for room in the ring)."""
        while self.futures_queue:
            try:
                self.futures_queue[-1]._drive_now(time.monotonic() + 0.002)
            except WaitExpired:
                return
            self.futures_queue.pop()

    # The fast path's state: on only while the leader is healthy and owes no late replies.
    _fast = False
    _fast_send: Callable[[Any, float | None], None]
    _fast_recv: dict[int, Callable[[], Any]] = {}

    def _refresh_fast(self) -> None:
        mq = self.rpc_broadcast_mq
        ok = (mq is not None and not self.is_failed and not self.shutting_down and not any(self._owed))
        if ok:
            self._fast_send = mq.enqueue
            self._fast_recv = {r: q.dequeue for r, q in enumerate(self.response_mqs)}
        self._fast = ok

    def _interrupted(self, name: str, e: BaseException, where: str) -> None:
        """An interrupt (Ctrl-C, an exception from a signal handler) cut a call off mid-way.

        It may have landed between a reply's read and its hand-over, or a
        message's write and its bookkeeping; which replies are still owed is
        then unknown, and a later call could be handed an earlier call's reply.
        So the executor takes no more calls (the interrupt itself propagates;
        shutdown is left to the caller, who is being interrupted).
        """
        with self._callback_lock:
            if self.is_failed or self.shutting_down:
                return
            self._failure = ExecutorFailed(
                f"RPC {name} was interrupted ({type(e).__name__}) while {where}; its replies can no longer be "
                f"matched to their calls for certain: shut this executor down and start a new one")
            self.is_failed = True
            self._fast = False
        logger.error("%s", self._failure)
        self._fire_failure_callback()

    def _owe(self, ranks: list[int]) -> None:
        """These ranks will still send a reply nobody waits for: skip it before reading theirs."""
        self._fast = False
        for r in ranks:
            self._owed[r] += 1

    def _cut_short(self, name: str) -> ExecutorFailed:
        if self._failure is None and not self.shutting_down:
            self._failure_known.wait(1.0)  # a worker that just left closed its queue first: wait for its name
        if self._failure is not None:
            return failed_as(self._failure, f"RPC {name} failed: {self._failure}")
        return failed_as(None, f"RPC {name} was cut short: the executor was shut down")

    def _raise_failed(self) -> None:
        if self._failure is not None:
            raise failed_as(self._failure, f"the executor failed earlier and takes no more calls: {self._failure}")
        raise failed_as(None, "the executor was shut down")

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Idempotent: close death pipes; wait; SIGTERM; wait; SIGKILL. Then release every queue.

        A second caller (say the engine, while the worker monitor is already
        shutting down after a failure) returns once the first has finished.
        """
        with self._callback_lock:
            first = not self.shutting_down
            self.shutting_down = True
            self._fast = False
        if not first:
            self._shutdown_done.wait()
            return
        if self._stall is not None:
            self._stall.stop()
        for mq in (self.rpc_broadcast_mq, *self.response_mqs):  # a thread blocked in a call returns now
            if mq is not None:
                mq.shutdown()
        try:
            self._shutdown()
        finally:
            self._shutdown_done.set()

    def _shutdown(self) -> None:
        if self.liveness is not None:  # tell the other nodes (and replicas) first: they stop too, at once
            self.liveness.stopped(self, self._failure, self._stop_reason or "")
        grace, term = self.config.shutdown_grace_s, self.config.shutdown_term_s
        if self._fast_stop:
            grace, term = min(grace, 0.2), min(term, 1.0)
        elif self._quick_stop:
            grace, term = min(grace, 1.0), min(term, 1.0)
        if self.group is not None:
            self.group.close(grace, term)
        for mq in (self.rpc_broadcast_mq, *self.response_mqs):
            if mq is not None:
                mq.close(flush_timeout=0)  # remote workers are stopped by their own node, not by CLOSE
        self.rpc_broadcast_mq = None
        if self._finalizer is not None:
            self._finalizer.detach()

    @staticmethod
    def _finalize(ref: weakref.ref) -> None:
        me = ref()
        if me is not None:
            me.shutdown()

