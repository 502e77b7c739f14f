"""`MultiprocExecutor`: one worker process per local rank, RPCs through the broadcast queue.

The leader (node_rank_within_dp 0) owns the RPC pipe (rpc.py) and reads every rank's replies; a follower node
runs the same class headless: it spawns its workers, watches them, and relays the broadcast (broadcast.py).
This module keeps the order of start-up (spawn, all READYs, then the queue handshakes as the workers do them),
the failure policy (a worker's death, a collective step's exception, a lost node: docs' architecture page,
"Fault model") and the staged shutdown.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from rayfree.cluster.config import ClusterConfig, require_config
from rayfree.transport import MessageQueue
from rayfree.transport.secure import policy as security
from rayfree.worker.main import refuse_reimported_main
from rayfree.worker.messages import Fatal

from .abstract import Executor
from .broadcast import NodeBroadcast
from .errors import FatalWorkerError, NotLeaderError, WorkerDied, failed_as
from .liveness import NodeLiveness
from .observe import StallWatch
from .peers import await_verdict, await_verdict_on_exit, cause_of
from .rpc import RpcPipe
from .startup import init_method, preflight, startup_cause, teardown_step, weak_callback
from .view import RpcSnapshot
from .workers import WorkerGroup, WorkerHandle, exit_description

__all__ = ["MultiprocExecutor"]

logger = logging.getLogger("rayfree.executor")

#: after a lost node or a fatal collective error: how long SIGTERM is given before SIGKILL (a rank blocked in a
#: collective runs no Python signal handler; one that is not leaves at once)
FAST_TERM_S = 0.3


class MultiprocExecutor(Executor):
    """One worker process per rank of this node; on the leader, every call broadcast to every rank. Calls from
    several threads take turns (send and receive together); a future's `result()` may be read from any thread."""

    supports_pp: bool = True

    def __init__(
        self,
        config: ClusterConfig,
        worker_cls: type | str,
        worker_kwargs: dict[str, Any] | None = None,
        monitor_workers: bool = True,
        liveness: NodeLiveness | None = None,
        *,
        secret: bytes | str | os.PathLike[str] | None = None,
    ) -> None:
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
        refuse_reimported_main("MultiprocExecutor")  # a spawned worker re-running an unguarded engine script
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
        self._started = False
        self.group: WorkerGroup | None = None
        #: the leader's queues and calls (None on a follower, and before start-up has made them)
        self.pipe: RpcPipe | None = None
        #: this node's end of the broadcast: node 0's queue (the pipe's), or a follower's relay
        self.broadcast: NodeBroadcast | None = None
        self._failure: Exception | None = None
        self._stop_reason: str | None = None
        self._fast_stop = False  # a node is gone: its peers may hang in gloo, so do not wait long for them
        self._quick_stop = False  # a worker died: the same, but its local peers get a second to stop cleanly
        self._stall: StallWatch | None = None
        self._latencies = False
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
        #: where the workers join torch.distributed (tcp://host:port)
        self.distributed_init_method = init_method(self.config)
        worker_cls = self.worker_cls if isinstance(self.worker_cls, str) else cloudpickle.dumps(self.worker_cls)
        success = False
        try:
            preflight(self.config, self.worker_cls)
            if self.liveness is None:
                if par.nnodes > 1 and par.replicas_per_node > 1:
                    raise ValueError(
                        f"node {par.node_rank} runs {par.replicas_per_node} DP replicas: start them "
                        f"together with rayfree.executor.NodeReplicas (or `rayfree node`)"
                    )
                self.liveness = NodeLiveness(self.config)
            self.liveness.attach(self)
            self.broadcast = NodeBroadcast(self.config, weak_callback(self._relay_broken))
            if self.broadcast.queue is not None:
                self.pipe = RpcPipe(
                    self.broadcast.queue,
                    self.world_size,
                    frozenset(self.config.collective_methods),
                    weak_callback(self._interrupted),  # the pipe must not keep us alive
                    self.config.spin_us,
                )
                self.pipe.recorder.histograms = self._latencies
                self.pipe.judge = weak_callback(self._judge_fatal)
            start = par.global_start_rank
            self.group = WorkerGroup(
                self.config,
                worker_cls,
                self.worker_kwargs,
                list(range(start, start + self.local_world_size)),
                self.distributed_init_method,
                self.broadcast.worker_handle(),
                on_ready=weak_callback(self._on_worker_ready),
            )
            if self.is_failed:  # failed while spawning (another node, a replica): `_fail` found no group to wake
                self.group.abort()
            self.group.wait_ready(self.config.ready_timeout_s)
            if self.monitor_workers:  # (the monitor must not keep us alive)
                self.group.start_monitor(weak_callback(self._on_worker_death), weak_callback(self._on_worker_fatal))
            self.liveness.ready()
            if self.pipe is not None:
                self.pipe.handshake(self.config.ready_timeout_s)
                self._stall = StallWatch(self, self.config.stall_report_s, self.config.stall_dump_s)
            self._started = True
            success = True
        except BaseException as e:
            self._stop_reason = f"start-up failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failure = startup_cause(e, lambda: self._failure, self.liveness)
            if failure is not None and failure is not e:
                raise failure from e  # a node left during start-up: that, not its fallout, is the cause
            raise
        finally:
            if not success:
                self.shutdown()

    def _on_worker_ready(self, w: WorkerHandle) -> None:
        if self.pipe is not None and self.group is not None:
            self.pipe.attach_replies(w.rank, w.reply_handle, w.peer_reply_handles, self.group.ranks)
        if self.broadcast is not None:
            self.broadcast.worker_ready(w.upstream)

    def _relay_broken(self, error: Exception) -> None:
        """This node's relay lost its stream: its parent node went away, most likely (the heartbeats say)."""
        await_verdict(self.liveness, type(error).__name__, str(error), what="the relay")
        if not self.stopped:
            self.fail(error)

    @property
    def workers(self) -> list[WorkerHandle]:
        """This node's worker processes (`.rank`, `.proc`)."""
        return self.group.workers if self.group is not None else []

    @property
    def rpc_broadcast_mq(self) -> MessageQueue | None:
        """The broadcast queue (vLLM's name; None on a follower)."""
        return self.pipe.broadcast if self.pipe is not None else None

    @property
    def response_mqs(self) -> list[MessageQueue]:
        """Every rank's reply queue, by rank (vLLM's name; empty on a follower)."""
        return self.pipe.replies if self.pipe is not None else []

    @classmethod
    def supports_async_scheduling(cls) -> bool:  # (vLLM's question)
        return True

    @property
    def failure(self) -> Exception | None:
        """Why the executor failed (None while it runs, or after a clean shutdown)."""
        return self._failure

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the executor has shut down (on request, on a failure, or when its leader stopped)."""
        return self._shutdown_done.wait(timeout)

    # -- what the node's machinery sees (view.ReplicaView) ----------------------------------

    @property
    def stopped(self) -> bool:
        return self.shutting_down or self.is_failed

    def rpc_snapshot(self) -> RpcSnapshot | None:
        return self.pipe.snapshot() if self.pipe is not None and not self.shutting_down else None

    def relay_status(self) -> dict[str, Any]:
        return self.broadcast.status() if self.broadcast is not None and not self.shutting_down else {}

    def relays_seen(self) -> dict[int, list[Any]]:
        return self.liveness.relays_seen() if self.liveness is not None else {}

    def dump_stacks(self, ranks: list[int]) -> None:
        if self.group is not None:
            self.group.dump_stacks([w for w in self.group.workers if w.rank in ranks])

    def record_latencies(self) -> None:
        self._latencies = True
        if self.pipe is not None:
            self.pipe.recorder.histograms = True

    def note_stop_reason(self, reason: str) -> None:
        """Why this executor is about to stop, for the other nodes (say, the engine's entry point raised)."""
        self._stop_reason = reason

    def fail(self, error: Exception) -> None:
        self._fast_stop = True  # another node or replica failed: peers may hang in gloo, do not wait long
        self._fail(error)

    # -- failures --------------------------------------------------------------------------

    def _on_worker_death(self, w: WorkerHandle) -> None:
        if self.stopped or (await_verdict_on_exit(self.liveness, w.proc.exitcode) and self.stopped):
            return  # (the second: its exit was a lost node's fallout, and that is the cause)
        how = exit_description(w.proc.exitcode)
        logger.error("%s died unexpectedly (%s); shutting down the executor", w.describe(), how)
        self._quick_stop = True  # its peers may be blocked in a collective with it, deaf to the death pipe
        self._fail(WorkerDied(w.rank, how, w.proc.pid, w.title))

    def _on_worker_fatal(self, w: WorkerHandle, msg: Fatal) -> None:
        """A collective step raised on rank `w.rank`: its peers may be stuck in a collective, so stop them all."""
        # A rank on another node that died shows up here first, as a collective's connection error; the
        # heartbeats name that node within their suspect window, and that is the cause to report.
        what = f"{w.describe()}: {msg.error_type} in {msg.method}"
        if self.stopped or (await_verdict(self.liveness, msg.error_type, msg.message, what=what) and self.stopped):
            return
        logger.error(
            "%s raised %s in %s, a collective step: failing the executor", w.describe(), msg.error_type, msg.method
        )
        self._fast_stop = True
        note = "a collective step: the executor has stopped every worker"
        self._fail(FatalWorkerError(msg.rank, msg.error_type, msg.message, msg.traceback, msg.method, note=note))

    def _judge_fatal(self, error: FatalWorkerError, name: str) -> Exception:
        """A caller got a rank's collective error: raise it once the failure is recorded and its callback ran, or
        the recorded cause when the error is a lost peer's consequence (peers.py, `cause_of`)."""
        known = self.pipe.failure_known if self.pipe is not None else None
        return cause_of(error, name, self.liveness, known, lambda: self._failure)

    def _fail(self, error: Exception) -> None:
        """Mark failed, run the failure callback, then wake every pending call with `error`, and shut down (a
        second shutdown, from the callback, waits for this one)."""
        with self._callback_lock:
            if self.is_failed:
                return
            self._failure = error
            self.is_failed = True
        if self.pipe is not None:  # new calls are refused with it from now on; pending ones wait for the callback
            self.pipe.note_failure(error)
        try:
            self._fire_failure_callback()
        except Exception:  # noqa: BLE001 - the engine's callback must not stop the failure from being handled
            logger.exception("the failure callback raised")
        if self.pipe is not None:  # blocked sends and receives return now
            self.pipe.fail(error)
        if self._started:
            self.shutdown()
            return
        if self.group is not None:
            # Start-up: the starting thread stops waiting for READY, raises this failure and shuts down (a
            # worker blocked in native code, say a rendezvous, does not hear SIGTERM: the staged close kills it).
            self._fast_stop = True
            self.group.abort()

    # -- RPC -----------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        aggregator: Callable[[list[Any]], Any] | None = None,
        kv_output_aggregator: Any = None,
        ec_output_aggregator: Any = None,
    ) -> Any:
        """See `Executor.collective_rpc`. Calls from several threads take turns (send and receive together)."""
        pipe = self.pipe
        if pipe is None:
            if not self.is_leader:
                raise NotLeaderError(
                    f"this is follower node {self.parallel_config.node_rank} (node "
                    f"{self.parallel_config.node_rank_within_dp} of its DP replica): only the "
                    f"leader node calls collective_rpc"
                )
            raise failed_as(
                self._failure,
                "the executor was shut down"
                if self._failure is None
                else f"the executor failed earlier and takes no more calls: {self._failure}",
            )
        connector = kv_output_aggregator if kv_output_aggregator is not None else ec_output_aggregator
        if connector is not None:
            if kv_output_aggregator is not None and ec_output_aggregator is not None:
                raise ValueError("give kv_output_aggregator or ec_output_aggregator, not both")
            reply_rank = unique_reply_rank or 0
            aggregator = lambda outputs: connector.aggregate(outputs, output_rank=reply_rank)  # noqa: E731
        return pipe.call(method, timeout, args, kwargs, non_block, unique_reply_rank, aggregator)

    def _interrupted(self, failure: Exception) -> bool:
        """An interrupt cut a call off mid-way: which replies are owed is unknown now, so the executor takes no
        more calls (the interrupt propagates; shutdown is the interrupted caller's). False if it had stopped."""
        with self._callback_lock:
            if self.is_failed or self.shutting_down:
                return False
            self._failure = failure
            self.is_failed = True
        if self.pipe is not None:
            self.pipe.note_failure(failure)
            self.pipe.failure_known.set()
        logger.error("%s", failure)
        self._fire_failure_callback()
        return True

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Idempotent: close death pipes; wait; SIGTERM; wait; SIGKILL. Then release every queue. A second
        caller (the engine, while the monitor already shuts down after a failure) returns once the first is done."""
        with self._callback_lock:
            first = not self.shutting_down
            self.shutting_down = True
        if not first:
            self._shutdown_done.wait()
            return
        if self._stall is not None:
            self._stall.stop()
        if self.pipe is not None:  # a thread blocked in a call returns now
            self.pipe.fail(None)
        try:
            self._shutdown()
        finally:
            self._shutdown_done.set()

    def _shutdown(self) -> None:
        grace, term = self.config.shutdown_grace_s, self.config.shutdown_term_s
        if self._fast_stop:  # ranks wait in a collective that will never complete: no grace, SIGKILL soon after
            grace, term = 0.0, min(term, FAST_TERM_S)
        elif self._quick_stop:
            grace, term = min(grace, 1.0), min(term, 1.0)
        # The other nodes (and replicas) are told first: they stop too, at once. Each step runs whatever the one
        # before did: one that raised must not leave the next one's processes or segments behind (logged).
        if self.liveness is not None:
            teardown_step("telling the others", self.liveness.stopped, self, self._failure, self._stop_reason or "")
        if self.group is not None:
            teardown_step("the workers' staged close", self.group.close, grace, term)
        if self.pipe is not None:
            teardown_step("the RPC pipe's close", self.pipe.close)
        if self.broadcast is not None:
            teardown_step("the broadcast's close", self.broadcast.close)
        if self._finalizer is not None:
            self._finalizer.detach()

    @staticmethod
    def _finalize(ref: weakref.ref[MultiprocExecutor]) -> None:
        me = ref()
        if me is not None:
            me.shutdown()
