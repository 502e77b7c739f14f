"""`NodePolicy`: what a failure means, decided in one place, on the supervisor's policy thread.

Every thread that notices something posts a `Failure` (rayfree/supervisor.py)
and goes on: the worker monitor (a death, a collective step's exception), the
heartbeats (a node lost, node 0's goodbye), a relay whose stream broke, a call
interrupted mid-way, a start-up thread, the operator's signal, the engine's
`shutdown()`. `apply` takes them in order. The rules:

- The node's first failure is the record: status, the probes and the entry's
  deadline read it; later ones are logged and change nothing. A failure of the
  node (a node lost, node 0 gone) fails every executor of the node with that
  error; one of an executor (its worker, its relay) fails that executor with it
  and the node's other DP replicas with `ReplicaFailed` (they share collectives).
- Independent DP replicas (`replica_coupling`): once the node's replicas run, a
  failure of some replicas (a worker's, a relay's, a node lost with its
  replicas, node 0's word that one was lost) fails those alone, with
  `ReplicaLost`; node 0 tells the lost replica's other nodes (`ReplicaDown`).
  A node left with no replica fails as a whole (below), and node 0 failing is
  the cluster failing: it is the heartbeats' hub and the engine's entry.
- A collective's error, or a broken relay, that reads like a lost peer waits
  for the heartbeats' verdict first (up to their suspect window): a node lost
  meanwhile is the cause to report.
- Failing an executor: record its failure, refuse new calls with it, run the
  engine's failure callback, then wake every pending call, tell the other
  nodes (`Bye`), and run its staged shutdown, whose grace follows the severity
  (FATAL: SIGTERM at once and SIGKILL FAST_TERM_S later; WORKER: at most a
  second each; STOP: the configured grace). During start-up the starting
  thread is woken instead, and raises the failure.
- Once the node has failed and its executors are closed, an entry point still
  running gets RAYFREE_ENTRY_GRACE_S to return, then is interrupted; a second
  later the process leaves regardless (rayfree/cli/node.py arms this).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rayfree.cluster.config import ParallelConfig
from rayfree.supervisor import Failure, Severity, SupervisorMisuse, supervisor

from .errors import (
    CallInterrupted,
    FatalWorkerError,
    NodeLost,
    ReplicaDrained,
    ReplicaFailed,
    ReplicaLost,
    WorkerDied,
    WorkerError,
)
from .peers import peer_gone
from .roster import Lost

if TYPE_CHECKING:
    from .roles import Node, PolicyExecutor

__all__ = ["NodePolicy", "FAST_TERM_S", "grace_of", "why_of"]

logger = logging.getLogger("rayfree.executor")

#: after a lost node or a fatal collective error: how long SIGTERM is given before SIGKILL (a rank blocked in a
#: collective runs no Python signal handler; one that is not leaves at once)
FAST_TERM_S = 0.3


#: what a cause weighs, by its type (the first that matches); any other cause is FATAL: a collective step raised,
#: a node, a link or a thread that watched them was lost, and ranks may wait in a collective that never ends
_WEIGHTS: tuple[tuple[type[BaseException], Severity], ...] = (
    (CallInterrupted, Severity.CALLER),  # the caller's own: recorded; the stop is the caller's
    (ReplicaDrained, Severity.WORKER),  # a planned stop of a replica (a lost one's weight would be FATAL)
    (WorkerDied, Severity.WORKER),  # its peers on this node get a moment to notice and leave
)


def severity_of(cause: BaseException | None) -> Severity:
    """How a failure is handled, from its cause's type (None: an orderly stop)."""
    if cause is None:
        return Severity.STOP
    return next((weight for kind, weight in _WEIGHTS if isinstance(cause, kind)), Severity.FATAL)


def why_of(cause: BaseException | None) -> str:
    """A failure in one line, for another replica's ReplicaFailed and the other nodes' goodbye."""
    if isinstance(cause, ReplicaFailed):
        return cause.why
    return str(cause).split("\n")[0]


def grace_of(severity: Severity, grace: float, term: float) -> tuple[float, float]:
    """The staged close's (grace, term) for a shutdown of this severity, from the configured ones."""
    if severity is Severity.FATAL:
        return 0.0, min(term, FAST_TERM_S)
    if severity is Severity.WORKER:  # its peers may be blocked in a collective with it, deaf to the death pipe
        return min(grace, 1.0), min(term, 1.0)
    return grace, term


def _replicas_hit(f: Failure, par: ParallelConfig) -> list[int] | None:
    """The DP replicas a failure belongs to (None: the node's, not one replica's)."""
    if f.executor is not None:
        return [f.executor.dp_rank]
    if isinstance(f.cause, NodeLost):
        return par.replicas_of_node(f.cause.node_rank)
    if isinstance(f.cause, ReplicaLost):
        return [f.cause.dp_rank]
    return None


def replica_lost(dp_rank: int, cause: BaseException | None, par: ParallelConfig, here: int) -> ReplicaLost:
    """Replica `dp_rank`'s loss, naming the node, the ranks (across DP) and the cause."""
    if isinstance(cause, ReplicaLost):
        return cause
    if isinstance(cause, NodeLost):
        return ReplicaLost(dp_rank, cause.node_rank, cause.ranks, cause.why, cause)
    if isinstance(cause, (WorkerDied, WorkerError)):
        rank = cause.rank
        what = (
            f"worker rank {rank} died ({cause.how})"
            if isinstance(cause, WorkerDied)
            else f"rank {rank} raised {cause.error_type}: {cause.message}"
        )
        return ReplicaLost(dp_rank, here, [par.global_rank(rank, dp_rank)], what, cause)
    ranks = [r for r in par.node_ranks(here) if r // par.world_size == dp_rank]
    return ReplicaLost(dp_rank, here, ranks, why_of(cause), cause if isinstance(cause, Exception) else None)


class _Entry:
    """The entry point running on this node's main thread, for its deadline after a failure."""

    def __init__(self, thread_id: int, grace_s: float, hard_s: float, exit_code: int) -> None:
        self.thread_id = thread_id
        self.grace_s = grace_s
        self.hard_s = hard_s
        self.exit_code = exit_code
        self.done = threading.Event()
        self.interrupted = False
        self.armed = False


class NodePolicy:
    """The failure domain of one node's liveness (`liveness.policy`): its record and its rules (module docstring)."""

    def __init__(self, liveness: Node) -> None:
        self.lv = liveness
        self.sup = supervisor()
        #: the node's first failure (None while it runs)
        self.record: Failure | None = None
        self._deferred: set[int] = set()
        self.entry: _Entry | None = None

    @property
    def lost(self) -> dict[int, ReplicaLost]:
        """The independent DP replicas this node knows are out of service (lost, drained, rejoining), each with
        its ReplicaLost (the roster's, roster.py)."""
        return self.lv.replica_epochs.roster.lost()

    # -- reports: from any thread --------------------------------------------------------------------

    def report(self, source: str, cause: Exception | None, executor: PolicyExecutor | None = None) -> None:
        """Post a failure (any thread); its cause's type says how it is handled (`severity_of`)."""
        self.sup.post(self.failure(source, cause, executor))

    def failure(self, source: str, cause: Exception | None, executor: PolicyExecutor | None = None) -> Failure:
        """The record of a failure of this domain, weighed by its cause's type."""
        return Failure(source, cause, severity_of(cause), self, executor)

    def stop(self, executor: PolicyExecutor | None, wait: bool) -> None:
        """An orderly stop of `executor` (None: every executor of the node); with `wait`, until it is closed.
        From the policy thread itself (a failure callback that shuts the executor down) it only starts it."""
        if self.sup.on_policy_thread():
            self.apply(self.failure("shutdown", None, executor))
            return
        self.report("shutdown", None, executor)
        if wait and executor is not None:
            executor.wait_done()

    # -- the rules: the policy thread --------------------------------------------------------------------

    def apply(self, f: Failure) -> None:
        """The policy thread only (its one door from the others is `report`); checked, as its state has no lock."""
        if not self.sup.on_policy_thread():
            raise SupervisorMisuse(f"the failure policy runs on the policy thread; report {f.source}'s instead")
        if f.severity is Severity.STOP:
            for ex in [f.executor] if f.executor is not None else self.lv.executors():
                if ex.starting:  # its starting thread stops waiting, raises and shuts down
                    ex.abort_startup()
                else:
                    self._shut(ex)
            self._arm_entry()
            return
        if f.severity is Severity.CALLER:
            self._record_only(f.executor, f.cause)
            return
        if self.record is not None:
            logger.debug("%s: %s (after the node's failure: nothing more to do)", f.source, f.cause)
            return
        if id(f) in self._deferred and self.lv.stopped_cleanly:
            # the verdict it waited for was node 0's clean stop: its close reached this node's ranks first
            logger.info("%s: %s came with node 0's clean stop; not a failure", f.source, why_of(f.cause))
            return
        if self._drained(f) or self._await_verdict(f) or self._replicas_only(f):
            return
        self.record = dataclasses.replace(f, domain=None, executor=None)  # (the record keeps no executor alive)
        self.lv.settled.set()
        why = why_of(f.cause)
        for ex in self.lv.executors():
            own = f.executor is None or ex is f.executor
            cause = f.cause if own else ReplicaFailed(f.executor.dp_rank, why)
            self._fail(ex, cause, f.severity)  # type: ignore[arg-type]
        self.lv.failed(f)  # the other nodes: Bye(failed), before the staged closes take their time
        for ex in self.lv.executors():
            if not ex.starting:
                self._shut(ex)
            else:
                ex.abort_startup()  # its starting thread raises the failure and shuts down

    def _drained(self, f: Failure) -> bool:
        """A failure of replicas that all drain (drain.py: its leader's stop, its workers leaving, its nodes'
        goodbyes): their planned stop, with no wait for a verdict. True if handled."""
        par, ep = self.lv.par, self.lv.replica_epochs
        hit = _replicas_hit(f, par) if not par.one_world else None
        return bool(hit) and all(ep.drains(k) for k in hit) and self._replicas_only(f)  # type: ignore[union-attr]

    def drained_only(self) -> bool:
        """Every replica of this node was drained (none lost): the node stops cleanly."""
        mine = self.lv.par.node_replicas
        return all(isinstance(self.lost.get(k), ReplicaDrained) for k in mine)

    def _replicas_only(self, f: Failure) -> bool:
        """Independent replicas: fail the replicas `f` hit and no other; True if that was all (the node keeps a
        replica that serves). A replica of this node that fails while it starts fails the node: its replicas
        start together. What a loss means is the roster's (roster.py): this carries out its decisions."""
        par = self.lv.par
        hit = None if par.one_world or par.data_parallel_size == 1 else _replicas_hit(f, par)
        if hit is None or any(ex.starting and ex.dp_rank in hit for ex in self.lv.executors()):
            return False
        door = self.lv.replica_epochs
        lost = [Lost(k, replica_lost(k, f.cause, par, self.lv.node)) for k in hit]
        decisions = [d for ev in lost for d in door.send(ev, act=False)]
        stopped = {d.dp_rank: d.cause for d in decisions if d.kind == "stop_replica"}
        mine = [ex for ex in self.lv.executors() if ex.dp_rank in stopped]
        for ex in mine:
            self._fail(ex, stopped[ex.dp_rank], f.severity)  # type: ignore[arg-type]
        door.act(decisions)  # (the replica callbacks, the groups across replicas)
        ends = [d for d in decisions if d.kind == "node_ends"]
        if ends:
            if not ends[-1].epoch:
                return False  # nothing left here: the node fails
            self.lv.stopped_cleanly = ends[-1].text
            self.lv.settled.set()  # (a leader's `finish` returns: its cluster, for it, stopped cleanly)
        for ex in mine:
            self._shut(ex)
        return True

    def _await_verdict(self, f: Failure) -> bool:
        """A collective's error or a broken relay that reads like a lost peer: wait (not here: the verdict comes
        through this thread) for the heartbeats, up to their suspect window, then look again. True if deferred."""
        cause = f.cause
        if f.executor is None or id(f) in self._deferred or not self.lv.verdict_s():
            return False
        if isinstance(cause, WorkerDied) and cause.how.startswith("exit code"):
            # a worker that left by itself (not killed) may have left because a peer node went away under it
            kind = "WorkerDied"
        elif isinstance(cause, FatalWorkerError):
            kind, text = cause.error_type, cause.message
        elif f.source.startswith("relay") and cause is not None:
            kind, text = type(cause).__name__, str(cause)
        else:
            return False
        if kind != "WorkerDied" and not peer_gone(kind, text):
            return False
        if kind != "WorkerDied" and self.lv.beater is not None and peer_gone(kind, text, timeouts=False):
            self.lv.beater.corroborate()  # a dropped heartbeat connection and a broken collective: a loss now
        logger.info(
            "%s: %s looks like a lost peer; waiting up to %.1fs for the heartbeats' verdict",
            f.source,
            kind,
            self.lv.verdict_s(),
        )
        self._deferred.add(id(f))
        self.sup.call_later(self.lv.verdict_s(), self.apply, f)
        return True

    def _record_only(self, ex: PolicyExecutor, cause: Exception | None) -> None:
        """A call interrupted mid-way: the executor takes no more calls; the stop is the interrupted caller's."""
        if ex is None or ex.is_failed or ex.shutting_down:
            return
        ex.mark_failed(cause, Severity.CALLER)
        if ex.pipe is not None and cause is not None:
            ex.pipe.note_failure(cause)
        logger.error("%s", cause)
        self._callback(ex)
        if ex.pipe is not None:
            ex.pipe.failure_known.set()  # (the interrupted caller waits for this before its interrupt goes on)

    def _fail(self, ex: PolicyExecutor, cause: Exception, severity: Severity) -> None:
        if ex.is_failed or ex.shutting_down:
            return
        ex.mark_failed(cause, severity)
        if ex.pipe is not None:  # new calls are refused with it from now on; pending ones wait for the callback
            ex.pipe.note_failure(cause)
        self._callback(ex)
        if ex.pipe is not None:  # blocked sends and receives return now, with it
            ex.pipe.fail(cause)

    @staticmethod
    def _callback(ex: PolicyExecutor) -> None:
        try:
            ex.fire_failure_callback()
        except Exception:  # noqa: BLE001 - the engine's callback must not stop the failure from being handled
            logger.exception("the failure callback raised")

    # -- the staged shutdown --------------------------------------------------------------------------------

    def _shut(self, ex: PolicyExecutor) -> None:
        """Begin `ex`'s staged shutdown (idempotent); its steps run on this thread, its last one sets it done."""
        if not ex.begin_shutdown():
            return
        self.lv.stopping(ex)
        grace, term = grace_of(ex.severity, ex.config.shutdown_grace_s, ex.config.shutdown_term_s)
        steps = ex.group.close_steps(grace, term) if ex.group is not None else iter(())
        self._drive(steps, lambda: self._closed(ex))

    def _drive(self, steps: Iterator[float], then: Callable[[], None]) -> None:
        try:
            delay = next(steps)
        except StopIteration:
            then()
            return
        self.sup.call_later(delay, self._drive, steps, then)

    def _closed(self, ex: PolicyExecutor) -> None:
        ex.release()
        if self.lv.owner is ex:  # an executor with a liveness of its own: its heartbeats end with it
            self._drive(self.lv.close_steps(), ex.mark_done)
        else:
            ex.mark_done()
        self._arm_entry()

    # -- the entry's deadline ------------------------------------------------------------------------------------

    def watch_entry(self, grace_s: float, hard_s: float, exit_code: int) -> _Entry:
        """The entry point runs on this (the main) thread from now until `entry.done` is set."""
        self.entry = _Entry(threading.get_ident(), grace_s, hard_s, exit_code)
        return self.entry

    def _arm_entry(self) -> None:
        e = self.entry
        if e is None or e.done.is_set() or e.armed or (self.record is None and not self.lv.stop_requested):
            return
        if any(not ex.done for ex in self.lv.executors()):
            return  # the entry waits for the shutdown (`ex.wait_done`): its grace starts when that is over
        e.armed = True
        what = f"the cluster failed ({why_of(self.record.cause)})" if self.record else f"{self.lv.stop_requested}"
        (logger.error if self.record else logger.info)(
            "node %d: %s; the entry point has %gs (RAYFREE_ENTRY_GRACE_S) to return, then this node stops it and exits",
            self.lv.node,
            what,
            e.grace_s,
        )
        self.sup.call_later(e.grace_s, self._interrupt_entry, e)

    def _interrupt_entry(self, e: _Entry) -> None:
        if e.done.is_set():
            return
        e.interrupted = True
        signal.pthread_kill(e.thread_id, signal.SIGUSR2)  # the node's handler raises EntryInterrupted there
        self.sup.call_later(e.hard_s, self._leave_without_entry, e)

    def _leave_without_entry(self, e: _Entry) -> None:
        if e.done.is_set():
            return
        from rayfree.procs import exit_now

        logger.error(
            "node %d: the entry point ignored the interrupt for %gs; abandoning it and leaving (exit %d)",
            self.lv.node,
            e.hard_s,
            e.exit_code,
        )
        exit_now(e.exit_code)
