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

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import cloudpickle

from cluster.heartbeat import Bye, HeartbeatClient, HeartbeatServer
from transport import MessageQueue, QueueClosed, QueueShutdown, QueueTimeout, TransportError, get_ip, get_open_port
from worker.messages import Boxed, RemoteError, is_special
from worker.proc import (UnreadyWorkerProcHandle, WorkerProc, WorkerProcHandle, WorkerStartupError,
                         exit_description)

from .abstract import Executor
from .errors import ExecutorFailed, LeaderLost, NodeLost, NotLeaderError, RpcTimeout, WorkerDied, WorkerError
from .future import FutureWrapper, WaitExpired

__all__ = ["MultiprocExecutor", "set_multiprocessing_worker_envs"]

logger = logging.getLogger("rayfree.executor")

#: How workers are started: spawn (default; safe with CUDA and threads) or fork.
START_METHOD_ENV = "RAYFREE_WORKER_MULTIPROC_METHOD"


@contextlib.contextmanager
def set_multiprocessing_worker_envs() -> Iterator[None]:
    """While workers start: one OpenMP thread each unless OMP_NUM_THREADS is set (N workers x all cores
    of threads only fight each other). The parent's own environment is restored afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if saved is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)


class MultiprocExecutor(Executor):
    """See the module docstring. `monitor_workers=False` leaves watching the workers to the caller."""

    def __init__(self, config, worker_cls, worker_kwargs=None, monitor_workers: bool = True) -> None:
        self.monitor_workers = monitor_workers
        self.shutting_down = False
        self._shutdown_done = threading.Event()
        self.workers: list[WorkerProcHandle] = []
        self.response_mqs: list[MessageQueue] = []
        self.rpc_broadcast_mq: MessageQueue | None = None
        self._failure: Exception | None = None
        self._monitor_wake_r = self._monitor_wake_w = None
        self._heartbeat: HeartbeatServer | HeartbeatClient | None = None
        self._stop_reason: str | None = None
        self._fast_stop = False  # a node is gone: its peers may hang in gloo, so do not wait long for them
        super().__init__(config, worker_cls, worker_kwargs)

    # -- start-up ------------------------------------------------------------------

    def _init_executor(self) -> None:
        self._finalizer = weakref.finalize(self, MultiprocExecutor._finalize, weakref.ref(self))
        par = self.parallel_config
        self.world_size = par.world_size
        self.local_world_size = par.local_ranks
        if self.world_size % par.nnodes_within_dp:
            raise ValueError(f"world size {self.world_size} must be divisible by the {par.nnodes_within_dp} "
                             f"node(s) of a DP replica")
        self.is_leader = par.node_rank_within_dp == 0
        multi_node = par.nnodes_within_dp > 1
        if multi_node:
            port = par.master_port or 29500
            distributed_init_method = f"tcp://{par.master_addr}:{port}"
        else:
            distributed_init_method = f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}"
        method = os.environ.get(START_METHOD_ENV, "spawn")
        if method not in ("spawn", "fork", "forkserver"):
            raise ValueError(f"{START_METHOD_ENV}={method!r}: use spawn, fork or forkserver")
        context = multiprocessing.get_context(method)
        worker_cls = self.worker_cls if isinstance(self.worker_cls, str) else cloudpickle.dumps(self.worker_cls)
        unready: list[UnreadyWorkerProcHandle] = []
        success = False
        try:
            if multi_node:
                from transport.security import require_secret
                require_secret(f"a cluster of {par.nnodes_within_dp} nodes")  # before anything starts
                self._start_heartbeat()
            handle = None
            if self.is_leader:
                connect_ip = get_ip(peer=par.master_addr) if multi_node else "127.0.0.1"
                self.rpc_broadcast_mq = MessageQueue(self.world_size, self.local_world_size,
                                                     list(range(self.local_world_size)), connect_ip=connect_ip)
                handle = self.rpc_broadcast_mq.export_handle().to_bytes()
            start = par.global_start_rank
            inherited: list[int] | None = [] if method == "fork" else None
            with set_multiprocessing_worker_envs():
                # Start every local worker before waiting for any: they join the world together.
                for local_rank in range(self.local_world_size):
                    rank = start + local_rank
                    uw = WorkerProc.make_worker_process(
                        context, self.config, worker_cls, self.worker_kwargs, local_rank, rank,
                        distributed_init_method, handle, par.is_driver_rank(rank), inherited)
                    unready.append(uw)
                    if inherited is not None:
                        inherited += [uw.ready_pipe.fileno(), uw.death_writer.fileno()]
            self.workers = WorkerProc.wait_for_ready(
                unready, self.config.ready_timeout_s,
                is_local_rank=lambda r: start <= r < start + self.local_world_size, attach=self.is_leader)
            if self.monitor_workers:
                self.start_worker_monitor()
            if self._heartbeat is not None:
                self._heartbeat.arm()
            if self.is_leader:
                self.response_mqs = [
                    self.workers[r].worker_response_mq if r < self.local_world_size
                    else self.workers[0].peer_worker_response_mqs[r] for r in range(self.world_size)]
                # The order the workers do it in: the broadcast queue, then the reply queues.
                self.rpc_broadcast_mq.wait_until_ready(timeout=self.config.ready_timeout_s)
                for mq in self.response_mqs:
                    mq.wait_until_ready(timeout=self.config.ready_timeout_s)
            self.futures_queue: deque[FutureWrapper] = deque()
            self._drive_lock = threading.RLock()
            # Replies still owed by calls that timed out: read and dropped before newer ones.
            self._owed = [0] * self.world_size
            if self.is_leader:
                self._refresh_fast()
            success = True
        except BaseException as e:
            if isinstance(e, (QueueTimeout, WorkerStartupError)) and "within" in str(e):
                self._dump_worker_stacks()
            self._stop_reason = f"start-up failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if self._failure is not None and not isinstance(e, KeyboardInterrupt):
                raise self._failure from e  # a node left during start-up: that, not its fallout, is the cause
            raise
        finally:
            if not success:
                if not self.workers:
                    self.workers = [WorkerProcHandle(uw.proc, uw.rank, None, [], uw.death_writer) for uw in unready]
                    for uw in unready:
                        uw.ready_pipe.close()
                self.shutdown()

    def _dump_worker_stacks(self) -> None:
        """Start-up timed out: have every live local worker print where it is stuck (to its stderr)."""
        import signal
        procs = [w.proc for w in self.workers] or []
        for p in procs:
            if p.is_alive() and p.pid is not None:
                logger.error("start-up timed out: worker %s (pid %d) stack follows on its stderr", p.name, p.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)
        if procs:
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)  # let them write it

    # -- nodes ---------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        par, cfg = self.parallel_config, self.config
        port = cfg.heartbeat_endpoint_port
        per_node = par.local_ranks
        me = weakref.ref(self)
        if self.is_leader:
            followers = {k: list(range(k * per_node, (k + 1) * per_node)) for k in range(1, par.nnodes_within_dp)}

            def on_lost(node: int, ranks: list[int], ip: str, why: str) -> None:
                ex = me()
                if ex is not None:
                    ex._fast_stop = True
                    ex._fail(NodeLost(node, ranks, ip, why))

            self._heartbeat = HeartbeatServer(_resolve(par.master_addr), port, followers, cfg.heartbeat_interval_s,
                                              cfg.heartbeat_timeout_s, on_lost)
            logger.info("leader: heartbeat endpoint %s; waiting for %d follower node(s) to join (join_timeout_s="
                        "%.0f)", self._heartbeat.endpoint, len(followers), cfg.join_timeout_s)
            return
        node = par.node_rank_within_dp
        ranks = list(range(par.global_start_rank, par.global_start_rank + per_node))

        def leader_lost(why: str) -> None:
            ex = me()
            if ex is not None:
                ex._fast_stop = True
                ex._fail(LeaderLost(node, why))

        def leader_bye(_node: int, clean: bool, reason: str) -> None:
            ex = me()
            if ex is None:
                return
            if clean:
                logger.info("node %d: the leader shut down; stopping this node's workers", node)
                ex.shutdown()
            else:
                ex._fast_stop = True
                ex._fail(LeaderLost(node, f"it stopped after a failure: {reason}"))

        self._heartbeat = HeartbeatClient(par.master_addr, port, node, ranks, get_ip(peer=par.master_addr),
                                          cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, leader_lost, leader_bye)
        logger.info("node %d: waiting for the leader (node 0) at %s:%d (heartbeats at %s) to form the world "
                    "(join_timeout_s=%.0f)", node, par.master_addr, par.master_port, self._heartbeat.endpoint,
                    cfg.join_timeout_s)

    @property
    def failure(self) -> Exception | None:
        """Why the executor failed (None while it runs, or after a clean shutdown)."""
        return self._failure

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the executor has shut down (on request, on a failure, or when its leader stopped)."""
        return self._shutdown_done.wait(timeout)

    # -- worker monitor ------------------------------------------------------------------

    def start_worker_monitor(self) -> None:
        """A thread that wakes when any worker process exits (or when shutdown tells it to stop)."""
        workers = list(self.workers)
        self_ref = weakref.ref(self)
        self._monitor_wake_r, self._monitor_wake_w = multiprocessing.Pipe(duplex=False)
        wake = self._monitor_wake_r

        def monitor() -> None:
            sentinels = {w.proc.sentinel: w for w in workers}
            ready = multiprocessing.connection.wait([*sentinels, wake])
            me = self_ref()
            if me is None or me.shutting_down:
                return
            dead = [sentinels[s] for s in ready if s in sentinels]
            if not dead:
                return
            w = dead[0]
            w.proc.join(0.5)
            how = exit_description(w.proc.exitcode)
            logger.error("worker rank %d (pid %s) died unexpectedly (%s); shutting down the executor",
                         w.rank, w.proc.pid, how)
            me._fail(WorkerDied(w.rank, how, w.proc.pid))

        threading.Thread(target=monitor, daemon=True, name="RayfreeWorkerMonitor").start()

    def _fail(self, error: Exception) -> None:
        """Mark failed, wake every pending call with `error`, shut down, fire the callback once."""
        with self._callback_lock:
            if self.is_failed:
                return
            self._failure = error
            self.is_failed = True
            self._fast = False
        for mq in self.response_mqs:  # pending dequeues raise now, and collect() reports `error`
            mq.shutdown()
        self.shutdown()
        self._fire_failure_callback()

    # -- RPC -----------------------------------------------------------------------------

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None,
                       aggregator: Callable[[list[Any]], Any] | None = None) -> Any:
        """See `Executor.collective_rpc`. One thread calls it at a time (futures' results may be read from
        any thread)."""
        recv = self._fast_recv.get(unique_reply_rank) if self._fast else None
        if (recv is not None and type(method) is str and type(unique_reply_rank) is int and not non_block
                and aggregator is None and not self.futures_queue):
            # The engine's step: a method name, one reply, nothing older pending.
            end = None if timeout is None else time.monotonic() + timeout
            try:
                self._fast_send((method, args, kwargs, unique_reply_rank), timeout)
            except QueueTimeout as e:
                raise RpcTimeout(f"RPC {method}: could not even send it before the {timeout}s deadline: {e}") \
                    from None
            except TransportError:
                raise self._cut_short(method)
            except Exception:  # the arguments could not be pickled: nothing was sent
                raise
            except BaseException as e:
                self._interrupted(method, e, "sending it")
                raise
            try:
                value = recv() if end is None else recv(max(0.0, end - time.monotonic()))
            except QueueTimeout:
                self._owe([unique_reply_rank])
                raise RpcTimeout(f"RPC {method} timed out after {timeout}s: rank(s) [{unique_reply_rank}] have "
                                 f"not replied") from None
            except TransportError:
                raise self._cut_short(method)
            except Exception as e:  # read, but not understood here (say, its class is not importable)
                raise _unreadable(unique_reply_rank, e, method) from e
            except BaseException as e:
                self._interrupted(method, e, "waiting for its reply")
                raise
            t = type(value)
            return _unwrap(value, method) if t is RemoteError or t is Boxed else value
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
        try:
            mq.enqueue((send, args, kwargs, output_rank),
                       timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except QueueTimeout as e:
            raise RpcTimeout(f"RPC {name}: could not even send it before the {timeout}s deadline: {e}") from None
        except (QueueShutdown, QueueClosed):
            self._raise_failed()
        except Exception:  # the arguments could not be pickled: nothing was sent
            raise
        except BaseException as e:
            self._interrupted(name, e, "sending it")
            raise
        ranks = list(range(self.world_size)) if output_rank is None else [output_rank]
        collect = _Collector(self, name, ranks, deadline, timeout, single=output_rank is not None)
        if not non_block and not self.futures_queue:
            # Nothing older is pending: read the replies here, without a Future.
            with self._drive_lock:
                value = collect(None)
            return value if aggregator is None else aggregator(value)
        fut = FutureWrapper(self.futures_queue, self._drive_lock, collect,
                            aggregator if aggregator is not None else (lambda x: x))
        return fut if non_block else fut.result()

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
        if self._failure is not None:
            e = ExecutorFailed(f"RPC {name} failed: {self._failure}")
            e.__cause__ = self._failure
            return e
        e = ExecutorFailed(f"RPC {name} was cut short: the executor was shut down")
        e.__suppress_context__ = True  # the queue's own error says nothing more
        return e

    def _raise_failed(self) -> None:
        if self._failure is not None:
            raise ExecutorFailed(f"the executor failed earlier and takes no more calls: {self._failure}") \
                from self._failure
        raise ExecutorFailed("the executor was shut down")

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
        try:
            self._shutdown()
        finally:
            self._shutdown_done.set()

    def _shutdown(self) -> None:
        if self._heartbeat is not None:  # tell the other side(s) first: they stop too, without a timeout
            reason = self._stop_reason or (str(self._failure).split("\n")[0] if self._failure else "shut down")
            clean = self._failure is None and self._stop_reason is None
            self._heartbeat.close(Bye(self.parallel_config.node_rank_within_dp, clean, reason[:300]))
        if self._monitor_wake_w is not None:
            self._monitor_wake_w.close()  # stop the monitor: it must not report our own stop as a failure
        workers = self.workers
        for w in workers:
            if w.death_writer is not None:
                w.death_writer.close()
                w.death_writer = None
        grace, term = self.config.shutdown_grace_s, self.config.shutdown_term_s
        if self._fast_stop:
            grace, term = min(grace, 0.2), min(term, 1.0)
        self._ensure_worker_termination([w.proc for w in workers], grace, term)
        mqs: list[MessageQueue | None] = [self.rpc_broadcast_mq, *self.response_mqs]
        for w in workers:
            mqs += [w.worker_response_mq, *w.peer_worker_response_mqs]
        for mq in mqs:
            if mq is not None:
                mq.close(flush_timeout=0)  # remote workers are stopped by their own node, not by CLOSE
        for w in workers:
            w.worker_response_mq = None
        self.rpc_broadcast_mq = None
        if self._monitor_wake_r is not None:
            self._monitor_wake_r.close()
        if self._finalizer is not None:
            self._finalizer.detach()

    @staticmethod
    def _ensure_worker_termination(procs: list, grace_s: float, term_s: float) -> None:
        """Stage 1: wait for a clean exit; 2: SIGTERM and wait; 3: SIGKILL."""
        def wait_all(limit: float) -> bool:
            end = time.monotonic() + limit
            for p in procs:
                p.join(max(0.0, end - time.monotonic()))
            return not any(p.is_alive() for p in procs)

        if wait_all(grace_s):
            return
        alive = [p for p in procs if p.is_alive()]
        logger.warning("workers %s still running %.0fs after shutdown; sending SIGTERM",
                       [p.name for p in alive], grace_s)
        for p in alive:
            p.terminate()
        if wait_all(term_s):
            return
        alive = [p for p in procs if p.is_alive()]
        logger.warning("workers %s ignored SIGTERM for %.0fs; sending SIGKILL", [p.name for p in alive], term_s)
        for p in alive:
            p.kill()
        for p in alive:
            p.join(5)

    @staticmethod
    def _finalize(ref: weakref.ref) -> None:
        me = ref()
        if me is not None:
            me.shutdown()


class _Collector:
    """Reads one RPC's replies rank by rank; resumable when the caller's wait runs out first."""

    def __init__(self, ex: MultiprocExecutor, name: str, ranks: list[int], deadline: float | None,
                 timeout: float | None, single: bool) -> None:
        self.ex = ex
        self.name = name
        self.ranks = ranks
        self.deadline = deadline
        self.timeout = timeout
        self.single = single
        self.got: dict[int, Any] = {}

    def __call__(self, wait_deadline: float | None) -> Any:
        ex = self.ex
        for rank in self.ranks:
            if rank in self.got:
                continue
            ends = [d for d in (self.deadline, wait_deadline) if d is not None]
            try:
                mq = ex.response_mqs[rank]
                while ex._owed[rank]:  # a late reply to a call that timed out: not ours
                    try:
                        mq.dequeue(timeout=None if not ends else max(0.0, min(ends) - time.monotonic()))
                    except TransportError:
                        raise
                    except Exception:  # noqa: BLE001 - unreadable, and dropped anyway
                        pass
                    ex._owed[rank] -= 1
                    if not any(ex._owed):
                        ex._refresh_fast()
                self.got[rank] = mq.dequeue(timeout=None if not ends else max(0.0, min(ends) - time.monotonic()))
            except QueueTimeout:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    missing = [r for r in self.ranks if r not in self.got]
                    ex._owe(missing)
                    busy = [r for r in missing if ex._owed[r] > 1]
                    raise RpcTimeout(f"RPC {self.name} timed out after {self.timeout}s: rank(s) {missing} have "
                                     f"not replied" + (f" (ranks {busy} are still busy with earlier calls that "
                                                       f"timed out)" if busy else "")) from None
                raise WaitExpired() from None
            except (TransportError, IndexError):
                raise ex._cut_short(self.name)
            except Exception as e:  # read, but not understood here: that rank's answer is this error
                logger.error("RPC %s: the reply of rank %d could not be read: %s", self.name, rank, e)
                self.got[rank] = _unreadable_reply(rank, e)
            except BaseException as e:
                ex._interrupted(self.name, e, "waiting for its replies")
                raise
        # Every expected reply is read (so none is left for the next call) before a failure is raised.
        values = [self.got[r] for r in self.ranks]
        for i, value in enumerate(values):
            if is_special(value):
                values[i] = _unwrap(value, self.name)
        return values[0] if self.single else values


def _unreadable_reply(rank: int, e: Exception) -> RemoteError:
    return RemoteError(rank, type(e).__name__, f"its reply arrived but could not be read here: {e}",
                       "(raised while unpickling the reply in the calling process)")


def _unreadable(rank: int, e: Exception, name: str) -> WorkerError:
    r = _unreadable_reply(rank, e)
    return WorkerError(rank, r.error_type, r.message, r.traceback, name)


def _unwrap(value: Any, name: str) -> Any:
    """A RemoteError reply becomes the caller's WorkerError; a Boxed one gives back its value."""
    if type(value) is RemoteError:
        raise WorkerError(value.rank, value.error_type, value.message, value.traceback, name)
    return value.value


def _resolve(host: str) -> str:
    """An address to bind for `host` (node 0's master_addr, which is one of its own addresses)."""
    import socket
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"master_addr={host!r} does not resolve ({e}): give node 0's IP address") from None
