"""Reading one RPC's replies, and turning what comes back (or what goes wrong) into the caller's result.

A reply is the method's value itself, a `RemoteError` (the worker raised) or
a `Boxed` value (a value that is itself one of those). Every failure of the
transport during a call is mapped to the executor's errors in one place,
`map_failure`, for both the engine's step path and the general path.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rayfree.transport import QueueBroken, QueueClosed, QueueShutdown, QueueTimeout, TransportError
from rayfree.worker.messages import RemoteError, is_special

from .errors import FatalWorkerError, RpcTimeout, WorkerError, failed_as
from .future import WaitExpired

if TYPE_CHECKING:
    from .multiproc import MultiprocExecutor

__all__ = ["Collector", "map_failure", "unwrap"]

logger = logging.getLogger("rayfree.executor")


def map_failure(ex: MultiprocExecutor, e: BaseException, name: str, where: str, timeout: float | None,
                ranks: list[int] | None = None) -> BaseException:
    """What the caller of RPC `name` gets for `e`, raised while `where` ("sending it", "waiting for its
    replies"); an interrupt (a BaseException that is not an Exception) also fails the executor."""
    out = _mapped(ex, e, name, where, timeout, ranks)
    if out is not e and out.__cause__ is None:
        out.__suppress_context__ = True  # the queue's own error says nothing more
    return out


def _mapped(ex: MultiprocExecutor, e: BaseException, name: str, where: str, timeout: float | None,
            ranks: list[int] | None) -> BaseException:
    if isinstance(e, QueueTimeout):
        if where == "sending it":
            return RpcTimeout(f"RPC {name}: could not even send it before the {timeout}s deadline: {e}")
        late = ranks or []
        ex._owe(late)
        busy = [r for r in late if ex._owed[r] > 1]
        return RpcTimeout(f"RPC {name} timed out after {timeout}s: rank(s) {late} have not replied"
                          + (f" (ranks {busy} are still busy with earlier calls that timed out)" if busy else ""))
    if isinstance(e, QueueBroken):  # a reply queue's TCP link dropped: say so, it is the cause
        failed = failed_as(None, f"RPC {name} failed: {e}")
        failed.__cause__ = e
        return failed
    if isinstance(e, (TransportError, QueueShutdown, QueueClosed, IndexError)):
        return ex._cut_short(name)
    if isinstance(e, Exception):
        if where == "sending it":
            return e  # the arguments could not be pickled: nothing was sent
        rank = ranks[0] if ranks else -1  # read, but not understood here (its class is not importable)
        return unwrap_error(unreadable_reply(rank, e), name)
    ex._interrupted(name, e, where)
    return e


def unreadable_reply(rank: int, e: Exception) -> RemoteError:
    return RemoteError(rank, type(e).__name__, f"its reply arrived but could not be read here: {e}",
                       "(raised while unpickling the reply in the calling process)")


def unwrap_error(r: RemoteError, name: str, fatal: bool = False) -> WorkerError:
    """The caller's error for a rank's exception; in a collective step (`fatal`) that also failed the executor,
    a FatalWorkerError, whichever of the reply and the rank's fatal report came first."""
    if fatal:
        return FatalWorkerError(r.rank, r.error_type, r.message, r.traceback, name,
                                note="a collective step: the executor has stopped every worker")
    return WorkerError(r.rank, r.error_type, r.message, r.traceback, name)


def unwrap(value: Any, name: str, fatal: bool = False) -> Any:
    """A RemoteError reply becomes the caller's WorkerError; a Boxed one gives back its value."""
    if type(value) is RemoteError:
        raise unwrap_error(value, name, fatal)
    return value.value


class Collector:
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
        #: this call in the executor's record (status, stall reports, metrics) until it ends
        self.call = ex.rpc_recorder.begin(name, ranks, self.got)

    def __call__(self, wait_deadline: float | None) -> Any:
        try:
            out = self._collect(wait_deadline)
        except WaitExpired:
            raise
        except BaseException:
            self.ex.rpc_recorder.end(self.call, False)
            raise
        self.ex.rpc_recorder.end(self.call, True)
        return out

    def _collect(self, wait_deadline: float | None) -> Any:
        ex = self.ex
        for rank in self.ranks:
            if rank in self.got:
                continue
            ends = [d for d in (self.deadline, wait_deadline) if d is not None]
            try:
                self.got[rank] = self._read(rank, None if not ends else min(ends))
            except QueueTimeout as e:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    missing = [r for r in self.ranks if r not in self.got]
                    raise map_failure(ex, e, self.name, "waiting for its replies", self.timeout, missing)
                raise WaitExpired() from None
            except (TransportError, IndexError) as e:
                raise map_failure(ex, e, self.name, "waiting for its replies", self.timeout)
            except Exception as e:  # read, but not understood here: that rank's answer is this error
                logger.error("RPC %s: the reply of rank %d could not be read: %s", self.name, rank, e)
                self.got[rank] = unreadable_reply(rank, e)
            except BaseException as e:
                raise map_failure(ex, e, self.name, "waiting for its replies", self.timeout)
        # Every expected reply is read (so none is left for the next call) before a failure is raised.
        values = [self.got[r] for r in self.ranks]
        for i, value in enumerate(values):
            if is_special(value):
                values[i] = unwrap(value, self.name, self.name in ex.config.collective_methods)
        return values[0] if self.single else values

    def _read(self, rank: int, end: float | None) -> Any:
        ex = self.ex
        mq = ex.response_mqs[rank]
        while ex._owed[rank]:  # a late reply to a call that timed out: not ours
            try:
                mq.dequeue(timeout=None if end is None else max(0.0, end - time.monotonic()))
            except TransportError:
                raise
            except Exception:  # noqa: BLE001 - unreadable, and dropped anyway
                pass
            ex._owed[rank] -= 1
            if not any(ex._owed):
                ex._refresh_fast()
        return mq.dequeue(timeout=None if end is None else max(0.0, end - time.monotonic()))
