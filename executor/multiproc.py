"""`MultiprocExecutor`: one worker process per local rank, RPCs through the broadcast queue.

The leader (node_rank_within_dp 0) owns the RPC pipe (rpc.py) and reads every rank's replies; a follower node
runs the same class headless: it spawns its workers, watches them, and relays the broadcast (broadcast.py). This
module keeps the order of start-up (spawn, all READYs, then the queue handshakes) and what the node's policy asks
of an executor: what a failure is reported as, how it is marked failed, and its staged shutdown's pieces."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from rayfree.cluster.config import ClusterConfig, require_config
from rayfree.supervisor import Severity
from rayfree.transport import MessageQueue
from rayfree.transport.secure import policy as security
from rayfree.worker.main import refuse_reimported_main
from rayfree.worker.messages import Fatal

from .abstract import Executor
from .broadcast import NodeBroadcast
from .drain import refuse_if_draining
from .errors import FatalWorkerError, NotLeaderError, WorkerDied, failed_as
from .liveness import NodeLiveness, for_node
from .membership import Membership
from .observe import StallWatch
from .peers import cause_of
from .rpc import RpcPipe
from .startup import init_method, preflight, startup_cause, teardown_step, weak_callback
from .status_messages import relays_seen
from .view import RpcSnapshot
from .workers import StartupAborted, WorkerGroup, WorkerHandle, exit_description

__all__ = ["MultiprocExecutor"]

logger = logging.getLogger("rayfree.executor")


class MultiprocExecutor(Executor):
    """One worker process per rank of this node; on the leader, every call broadcast to every rank. Calls from
    several threads take turns (send and receive together); a future's `result()` may be read from any thread."""

    supports_pp: bool = True
    membership: Membership | None = None  # (a leader of coupled DP replicas: membership.py)

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
        #: how bad its failure was: the staged shutdown's grace follows from it (policy.grace_of)
        self.severity = Severity.STOP
        self._closing = False
        #: start-up runs (its thread shuts the executor down if it fails): a stop or failure wakes that thread
        self.starting = True
        self._abort_requested = False
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
            self.config = preflight(self.config, self.worker_cls)  # (with the device the worker class declares)
            if self.liveness is None:
                if par.nnodes > 1 and par.replicas_per_node > 1:
                    raise ValueError(
                        f"node {par.node_rank} runs {par.replicas_per_node} DP replicas: start them "
                        f"together with rayfree.executor.NodeReplicas (or `rayfree node`)"
                    )
                self.liveness = for_node(self.config, owner=self)
            self.liveness.attach(self)
            self.broadcast = NodeBroadcast(self.config, weak_callback(self._report_relay))
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
                if par.coupled:  # (its groups across replicas are formed again before a call: membership.py)
                    self.membership = Membership(self)
                    self.pipe.before = self.membership.before_call
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
            if self.is_failed or self._abort_requested:  # failed or stopped while spawning: nothing to wake then
                self.group.abort()
            self.group.wait_ready(self.config.ready_timeout_s)
            if self.monitor_workers:  # (the monitor must not keep us alive)
                self.group.start_monitor(weak_callback(self._report_death), weak_callback(self._report_fatal))
            self.liveness.ready()
            if self.pipe is not None:
                self.pipe.handshake(self.config.ready_timeout_s)
                self._stall = StallWatch(self, self.config.stall_report_s, self.config.stall_dump_s).start()
            self._started = True
            if self._failure is not None:  # it failed while the last steps ran: that is start-up's outcome
                raise self._failure
            if self._abort_requested:
                raise StartupAborted("the node was stopped while this executor started")
            success = True
        except BaseException as e:
            self._stop_reason = f"start-up failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.severity = max(self.severity, Severity.FATAL)  # ranks may sit in the rendezvous, deaf to SIGTERM
            failure = startup_cause(e, lambda: self._failure, self.liveness)
            if failure is not None and failure is not e:
                raise failure from e  # a node left during start-up: that, not its fallout, is the cause
            raise
        finally:
            self.starting = False
            if not success:
                self.shutdown()

    def _on_worker_ready(self, w: WorkerHandle) -> None:
        if self.pipe is not None and self.group is not None:
            self.pipe.attach_replies(w.rank, w.reply_handle, w.peer_reply_handles, self.group.ranks)
        if self.broadcast is not None:
            self.broadcast.worker_ready(w.upstream)

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

    @property
    def started(self) -> bool:
        return self._started

    @property
    def done(self) -> bool:
        return self._shutdown_done.is_set()

    @property
    def stop_reason(self) -> str:
        return self._stop_reason or ""

    # -- what the node's machinery sees (view.ReplicaView) ----------------------------------

    @property
    def stopped(self) -> bool:
        return self.shutting_down or self.is_failed

    def rpc_snapshot(self) -> RpcSnapshot | None:
        return self.pipe.snapshot() if self.pipe is not None and not self.shutting_down else None

    def relay_status(self) -> dict[str, Any]:
        return self.broadcast.status() if self.broadcast is not None and not self.shutting_down else {}

    def relays_seen(self) -> dict[int, list[Any]]:
        return relays_seen(self.liveness) if self.liveness is not None else {}

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

    # -- failures: reported from the threads that notice them, decided by the node's policy --------------------

    def _report_death(self, w: WorkerHandle) -> None:
        if self.stopped:
            return
        how = exit_description(w.proc.exitcode)
        logger.error("%s died unexpectedly (%s); shutting down the executor", w.describe(), how)
        self._report(w.describe(), WorkerDied(w.rank, how, w.proc.pid, w.title))

    def _report_fatal(self, w: WorkerHandle, msg: Fatal) -> None:
        """A collective step raised on rank `w.rank`: its peers may be stuck in a collective, so stop them all."""
        if self.stopped:
            return
        logger.error("%s raised %s in %s, a collective step", w.describe(), msg.error_type, msg.method)
        note = "a collective step: the executor has stopped every worker"
        error = FatalWorkerError(msg.rank, msg.error_type, msg.message, msg.traceback, msg.method, note=note)
        self._report(w.describe(), error)

    def _report_relay(self, error: Exception) -> None:
        """This node's relay lost its stream: its parent node went away, most likely (the heartbeats say)."""
        self._report(f"the relay of node {self.parallel_config.node_rank}", error)

    def _report(self, source: str, cause: Exception) -> None:
        if self.liveness is not None:
            self.liveness.policy.report(source, cause, self)

    def _judge_fatal(self, error: FatalWorkerError, name: str) -> Exception:
        """A caller got a rank's collective error: what it raises (membership.py's judge, else `cause_of`)."""
        known = self.pipe.failure_known if self.pipe is not None else None
        changed = self.membership.judge(error, name) if self.membership is not None else None
        return changed or cause_of(error, name, self.liveness, known, lambda: self._failure)

    # -- what the policy does with it (its thread) ---------------------------------------------------------

    def mark_failed(self, cause: Exception | None, severity: Severity) -> None:
        """The node's policy recorded `cause` as this executor's failure."""
        with self._callback_lock:
            self._failure = cause
            self.is_failed = True
            self.severity = max(self.severity, severity)

    def abort_startup(self) -> None:
        """A stop or a failure during start-up: the starting thread stops waiting, raises and shuts down."""
        self._abort_requested = True
        if self.group is not None:
            self.group.abort()

    def begin_shutdown(self) -> bool:
        """The staged shutdown starts (False: it had already): no call is served from now on."""
        with self._callback_lock:
            if self._closing:
                return False
            self._closing = self.shutting_down = True
        if self._stall is not None:
            self._stall.stop()
        if self.pipe is not None:  # a thread blocked in a call returns now
            self.pipe.fail(None)
        return True

    def release(self) -> None:
        """The workers are gone: every queue and socket goes too."""
        if self.pipe is not None:  # (each runs whatever the one before did)
            teardown_step("the RPC pipe's close", self.pipe.close)
        if self.broadcast is not None:
            teardown_step("the broadcast's close", self.broadcast.close)
        if self._finalizer is not None:
            self._finalizer.detach()

    def mark_done(self) -> None:
        """The staged shutdown is over: `wait_done` returns."""
        self._shutdown_done.set()

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
        refuse_if_draining(self)  # (`rayfree drain`: a draining replica takes no new call)
        connector = kv_output_aggregator if kv_output_aggregator is not None else ec_output_aggregator
        if connector is not None:
            if kv_output_aggregator is not None and ec_output_aggregator is not None:
                raise ValueError("give kv_output_aggregator or ec_output_aggregator, not both")
            reply_rank = unique_reply_rank or 0
            aggregator = lambda outputs: connector.aggregate(outputs, output_rank=reply_rank)  # noqa: E731
        return pipe.call(method, timeout, args, kwargs, non_block, unique_reply_rank, aggregator)

    def _interrupted(self, failure: Exception) -> bool:
        """An interrupt cut a call off mid-way (the caller's thread): the replies owed are unknown now, so the
        executor takes no more calls (the policy records it; the stop is the caller's). False if it had stopped."""
        if self.stopped:
            return False
        if self.pipe is not None:  # refused from this moment, on this thread
            self.pipe.note_failure(failure)
        self._report("an interrupted call", failure)
        if self.pipe is not None:  # recorded and the engine told, before the interrupt goes on (bounded)
            self.pipe.failure_known.wait(5.0)  # (milliseconds; seconds on a starved machine)
        return True

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Idempotent: close death pipes; wait; SIGTERM; wait; SIGKILL; release every queue. The policy's thread
        runs the stages; this returns once they are done (from a failure callback, on that thread: starts them)."""
        if self._shutdown_done.is_set():
            return
        if self.liveness is None:  # nothing was started
            self.shutting_down = True
            self._shutdown_done.set()
            return
        self.liveness.policy.stop(self, wait=True)

    @staticmethod
    def _finalize(ref: weakref.ref[MultiprocExecutor]) -> None:
        me = ref()
        if me is not None:
            me.shutdown()
