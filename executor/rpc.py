"""The RPC pipe: a leader's broadcast queue and every rank's reply queue, and the one way a call goes through them.

`RpcPipe.call` sends one message to every rank, then reads the replies it
asked for, rank by rank, in call order: a call made while older ones are
pending becomes a `FutureWrapper` behind them (replies come back through
per-rank FIFO queues, so the reply to call 2 can only be read after the reply
to call 1). A call that timed out leaves its replies *owed*: they are read and
dropped before newer ones. Calls from several threads take turns (send and
receive together, under one lock), so no thread is handed another's reply.

What comes back is the method's value, a `RemoteError` (the worker raised)
or a `Boxed` value (a value that is itself one of those); every failure of
the transport during a call is mapped to the executor's errors in one place,
`RpcPipe.map_failure`, and a rank's collective error is judged by the
executor (`judge`: a lost node may be its cause). `fail(error)` wakes every
blocked call; `snapshot()` is what status, metrics and the stall watch read
(another thread, racy by design). Unlike vLLM's futures, `result(timeout=)`
works (futures.py): a wait that runs out leaves the call pending, and a later `result()`
continues where it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle

from rayfree.transport import MessageQueue, QueueBroken, QueueClosed, QueueShutdown, QueueTimeout, TransportError
from rayfree.worker.messages import Boxed, RemoteError, is_special

from .errors import CallInterrupted, FatalWorkerError, RpcTimeout, failed_as, unreadable_reply, unwrap, unwrap_error
from .futures import FutureWrapper, WaitExpired
from .observe import Call, RpcRecorder
from .view import RpcSnapshot

__all__ = ["RpcPipe", "FutureWrapper", "WaitExpired"]

logger = logging.getLogger("rayfree.executor")

_perf = time.perf_counter


class RpcPipe:
    """The leader's queues to and from `world_size` ranks (see the module docstring).

    `on_interrupted(error)` is told when an interrupt cut a call off mid-way (the executor then takes no
    more calls); `failure_known` is set once the executor knows why it failed.
    """

    def __init__(
        self,
        broadcast: MessageQueue,
        world_size: int,
        collective_methods: frozenset[str],
        on_interrupted: Callable[[Exception], None],
        spin_us: float | None,
    ) -> None:
        self.broadcast = broadcast
        #: `MessageQueue.enqueue` of the broadcast queue, bound once: every call is sent through it (the hot path)
        self._enqueue = broadcast.enqueue
        self.replies: list[MessageQueue] = []
        self._attached: dict[int, MessageQueue] = {}
        self.world_size = world_size
        self.collective_methods = collective_methods
        self.lock = threading.RLock()
        self.recorder = RpcRecorder(world_size)
        #: pending non-blocking calls, newest on the left
        self.futures: deque[FutureWrapper] = deque()
        #: replies still owed by calls that timed out, per rank: read and dropped before newer ones
        self.owed = [0] * world_size
        self.failure: Exception | None = None
        self.failure_known = threading.Event()
        self.judge: Callable[[FatalWorkerError, str], Exception] | None = None
        #: run under the lock before each call goes out (coupled replicas form their groups again: membership.py)
        self.before: Callable[[], None] | None = None
        self.stopping = False
        self._on_interrupted = on_interrupted
        self._spin_us = spin_us

    # -- set-up and the end ------------------------------------------------------------------

    def attach_replies(self, rank: int, handle: bytes | None, peers: list[bytes], local: list[int]) -> None:
        """At a worker's READY: become the reader of its reply queue and (worker 0 of a replica across nodes)
        of the other nodes' ranks' queues, whose handles its READY carries."""
        for r, raw in [(rank, handle), *((p, h) for p, h in enumerate(peers) if p not in local)]:
            if raw and r not in self._attached:
                self._attached[r] = MessageQueue.create_from_handle(raw, 0, spin_us=self._spin_us)

    def handshake(self, timeout: float | None) -> None:
        """The order the workers do it in: the broadcast queue, then the reply queues (by rank)."""
        missing = [r for r in range(self.world_size) if r not in self._attached]
        if missing:
            raise RuntimeError(f"no reply queue for rank(s) {missing}: their workers' READY did not name one")
        self.replies = [self._attached[r] for r in range(self.world_size)]
        self.broadcast.wait_until_ready(timeout=timeout)
        for mq in self.replies:
            mq.wait_until_ready(timeout=timeout)

    def note_failure(self, error: Exception) -> None:
        """The executor failed with `error`: new calls are refused with it; blocked ones wake at `fail`."""
        if self.failure is None:
            self.failure = error

    def fail(self, error: Exception | None) -> None:
        """Wake every blocked call: with `error` (the executor's failure), or None (it is shutting down)."""
        if error is None:
            self.stopping = True
        else:
            if self.failure is None:
                self.failure = error
            self.failure_known.set()
        for mq in (self.broadcast, *self._attached.values()):
            mq.shutdown()

    def close(self) -> None:
        for mq in (self.broadcast, *self._attached.values()):
            mq.close(flush_timeout=0)  # remote workers are stopped by their own node, not by CLOSE

    def snapshot(self) -> RpcSnapshot:
        rec = self.recorder
        return RpcSnapshot(
            rec.in_flight(),
            rec.since_last_reply(),
            rec.failures,
            self.broadcast.status(),
            {m: (list(h.counts), h.sum) for m, h in list(rec.hist.items())},
        )

    # -- a call ----------------------------------------------------------------------------------

    def call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        unique_reply_rank: int | None,
        aggregator: Callable[[Any], Any] | None,
    ) -> Any:
        with self.lock:
            if self.failure is not None or self.stopping:
                raise self.failed()
            if self.before is not None:
                self.before()
            output_rank = None if aggregator is not None else unique_reply_rank
            if unique_reply_rank is not None and (
                type(unique_reply_rank) is not int or not 0 <= unique_reply_rank < self.world_size
            ):
                raise ValueError(f"unique_reply_rank={unique_reply_rank!r} is not a rank (0..{self.world_size - 1})")
            deadline = None if timeout is None else time.monotonic() + timeout
            if type(method) is str:
                send: Any = method
                name = method
            else:
                send, name = cloudpickle.dumps(method), getattr(method, "__name__", "<callable>")
            ranks = list(range(self.world_size)) if output_rank is None else [output_rank]
            in_place = not non_block and not self.futures  # nothing older pending: read here, without a Future
            collect = Collector(self, name, ranks, deadline, timeout, output_rank is not None, in_place)
            try:
                # While the ring is full, read the replies of older calls: the workers may wait for that room.
                self._enqueue((send, args, kwargs, output_rank), timeout, self._drain if self.futures else None)
            except (QueueShutdown, QueueClosed):
                self.recorder.end(collect, False)
                if self.failure is None and not self.stopping:
                    self.failure_known.wait(1.0)  # a worker just left: the monitor names it within a second
                raise self.failed() from None
            except BaseException as e:
                self.recorder.end(collect, False)
                raise self.map_failure(e, name, "sending it", timeout)  # noqa: B904 - map_failure sets the cause
            if in_place:
                value = collect(None)
                return value if aggregator is None else aggregator(value)
            fut = FutureWrapper(self.futures, self.lock, collect, aggregator if aggregator is not None else _same)
            return fut if non_block else fut.result()

    def _drain(self) -> None:
        """Read the replies of pending calls that have them now (a send is waiting for room in the ring)."""
        while self.futures:
            try:
                self.futures[-1].drive_now(time.monotonic() + 0.002)
            except WaitExpired:
                return
            self.futures.pop()

    # -- what goes wrong ---------------------------------------------------------------------------

    def failed(self, name: str | None = None) -> Exception:
        """The error for a call the executor can no longer serve (`name`: a call that was under way)."""
        if not self.failure_known.is_set() and (self.failure is not None or (name is not None and not self.stopping)):
            # The failure callback runs before a pending call raises; a worker that just left closed its queue
            # before the monitor could name it: either way the name comes within a second.
            self.failure_known.wait(1.0)
        f = self.failure
        if name is None:
            if f is not None:
                return failed_as(f, f"the executor failed earlier and takes no more calls: {f}")
            return failed_as(None, "the executor was shut down")
        if f is not None:
            return failed_as(f, f"RPC {name} failed: {f}")
        return failed_as(None, f"RPC {name} was cut short: the executor was shut down")

    def map_failure(
        self, e: BaseException, name: str, where: str, timeout: float | None, ranks: list[int] | None = None
    ) -> BaseException:
        """What the caller of RPC `name` gets for `e`, raised while `where` ("sending it", "waiting for its
        replies"); an interrupt (a BaseException that is not an Exception) also fails the executor."""
        out = self._mapped(e, name, where, timeout, ranks)
        if out is not e and out.__cause__ is None:
            out.__suppress_context__ = True  # the queue's own error says nothing more
        return out

    def _mapped(
        self, e: BaseException, name: str, where: str, timeout: float | None, ranks: list[int] | None
    ) -> BaseException:
        if isinstance(e, QueueTimeout):
            if where == "sending it":
                return RpcTimeout(f"RPC {name}: could not even send it before the {timeout}s deadline: {e}")
            for r in (late := ranks or []):  # these ranks will still send a reply nobody waits for: skip it later
                self.owed[r] += 1
            busy = [r for r in late if self.owed[r] > 1]
            return RpcTimeout(
                f"RPC {name} timed out after {timeout}s: rank(s) {late} have not replied"
                + (f" (ranks {busy} are still busy with earlier calls that timed out)" if busy else "")
            )
        if isinstance(e, QueueBroken):  # a reply queue's TCP link dropped: say so, it is the cause
            (failed := failed_as(None, f"RPC {name} failed: {e}")).__cause__ = e
            return failed
        if isinstance(e, (TransportError, QueueShutdown, QueueClosed, IndexError)):
            return self.failed(name)
        if isinstance(e, Exception):
            if where == "sending it":
                return e  # the arguments could not be pickled: nothing was sent
            rank = ranks[0] if ranks else -1  # read, but not understood here (its class is not importable)
            return unwrap_error(unreadable_reply(rank, e), name)
        # An interrupt (Ctrl-C, an exception from a signal handler) cut the call off mid-way: it may have landed
        # between a reply's read and its hand-over, so which replies are still owed is unknown from now on.
        cut = CallInterrupted(
            f"RPC {name} was interrupted ({type(e).__name__}) while {where}; "
            f"its replies can no longer be matched to their calls for certain: "
            f"shut this executor down and start a new one"
        )
        cut.__suppress_context__ = True
        self._on_interrupted(cut)
        return e


def _same(x: Any) -> Any:
    return x


class Collector(Call):
    """Reads one RPC's replies rank by rank; resumable when the caller's wait runs out first. It is the call's
    entry in the pipe's record (status, stall reports, metrics) until it ends."""

    __slots__ = ("pipe", "deadline", "timeout", "single")

    def __init__(
        self,
        pipe: RpcPipe,
        name: str,
        ranks: list[int],
        deadline: float | None,
        timeout: float | None,
        single: bool,
        in_place: bool,
    ) -> None:
        self.name = name
        self.t0 = _perf()
        self.ranks = ranks
        self.got: dict[int, Any] = {}
        self.pipe = pipe
        self.deadline = deadline
        self.timeout = timeout
        self.single = single
        if in_place:  # read by the caller now (calls take turns: one at a time)
            pipe.recorder.current = self
        else:  # a future's
            pipe.recorder.calls.append(self)

    def __call__(self, wait_deadline: float | None) -> Any:
        pipe = self.pipe
        got = self.got
        try:
            for rank in self.ranks:
                if rank in got:
                    continue
                end = (
                    self.deadline
                    if wait_deadline is None
                    else (wait_deadline if self.deadline is None else min(self.deadline, wait_deadline))
                )
                try:
                    mq = pipe.replies[rank]
                    if pipe.owed[rank]:
                        self._drop_owed(rank, mq, end)
                    got[rank] = mq.dequeue(None if end is None else max(0.0, end - time.monotonic()))
                except QueueTimeout as e:
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        missing = [r for r in self.ranks if r not in got]
                        raise pipe.map_failure(e, self.name, "waiting for its replies", self.timeout, missing)  # noqa: B904 - map_failure sets the cause
                    raise WaitExpired() from None
                except (TransportError, IndexError) as e:
                    raise pipe.map_failure(e, self.name, "waiting for its replies", self.timeout)  # noqa: B904 - map_failure sets the cause
                except Exception as e:  # read, but not understood here: that rank's answer is this error
                    logger.error("RPC %s: the reply of rank %d could not be read: %s", self.name, rank, e)
                    got[rank] = unreadable_reply(rank, e)
                except BaseException as e:
                    raise pipe.map_failure(e, self.name, "waiting for its replies", self.timeout, [rank])  # noqa: B904 - map_failure sets the cause
            # Every expected reply is read (so none is left for the next call) before a failure is raised.
            if self.single:
                out = got[self.ranks[0]]
                t = type(out)
                if t is RemoteError or t is Boxed:
                    out = unwrap(out, self.name, self.name in pipe.collective_methods)
            else:
                fatal = self.name in pipe.collective_methods
                out = [unwrap(v, self.name, fatal) if is_special(v) else v for v in (got[r] for r in self.ranks)]
        except WaitExpired:
            raise
        except BaseException as e:
            pipe.recorder.end(self, False)
            cause = pipe.judge(e, self.name) if pipe.judge is not None and isinstance(e, FatalWorkerError) else None
            if cause is not None and cause is not e:
                raise cause from e
            raise
        pipe.recorder.end(self, True)
        return out

    def _drop_owed(self, rank: int, mq: MessageQueue, end: float | None) -> None:
        """Read and drop the late replies of calls that timed out: not ours."""
        pipe = self.pipe
        while pipe.owed[rank]:
            try:
                mq.dequeue(None if end is None else max(0.0, end - time.monotonic()))
            except TransportError:
                raise
            except Exception:  # noqa: BLE001 - unreadable, and dropped anyway
                pass
            pipe.owed[rank] -= 1
