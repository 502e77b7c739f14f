"""What `collective_rpc` and the executor raise; each names the rank(s) concerned.

Why the executor failed has a class of its own (`WorkerDied`, `NodeLost`,
`LeaderLost`, `ReplicaFailed`, `ReplicaLost`, `FatalWorkerError`), and each is also an
`ExecutorFailed`: a caller may catch the cause by name, or every failure at
once. `failed_as` is the one rule that turns the failure into what a pending
or later call raises: the same class, with the call named in the message.
"""

from __future__ import annotations

from typing import Any

from rayfree.worker.messages import RemoteError

__all__ = [
    "ExecutorError",
    "WorkerError",
    "WorkerDied",
    "RpcTimeout",
    "ExecutorFailed",
    "CallInterrupted",
    "NotLeaderError",
    "NodeLost",
    "LeaderLost",
    "ReplicaFailed",
    "ReplicaLost",
    "ReplicaDrained",
    "ReplicasChanged",
    "WorkerStartupError",
    "StartupTimeout",
    "FatalWorkerError",
    "failed_as",
]


class ExecutorError(RuntimeError):
    """Base of the executor's errors."""


class ExecutorFailed(ExecutorError):
    """The executor failed (a worker died, a node was lost, ...) or was shut down; it takes no more calls.

    The failure's own class is kept: `except NodeLost` and `except ExecutorFailed` both catch a lost node."""


class CallInterrupted(ExecutorFailed):
    """An interrupt (Ctrl-C, an exception from a signal handler) cut a call off mid-way: which replies are still
    owed is unknown, so the executor takes no more calls. The caller's own doing: the stop is the caller's."""


class WorkerError(ExecutorError):
    """A worker's method raised: its rank, exception type, message and the worker's traceback."""

    def __init__(
        self, rank: int, error_type: str, message: str, remote_traceback: str, method: str = "", note: str = ""
    ) -> None:
        where = f" in {method}" if method else ""
        super().__init__(
            f"worker rank {rank} raised {error_type}{where}: {message}"
            + (f" ({note})" if note else "")
            + f"\n\nWorker traceback (rank {rank}):\n{remote_traceback}"
        )
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback


class FatalWorkerError(WorkerError, ExecutorFailed):
    """A rank raised in a collective step (`collective_methods`): its peers may be stuck with it, so the
    executor failed and stopped every worker. A `WorkerError` (rank, type, traceback) and an `ExecutorFailed`."""


class WorkerDied(ExecutorFailed):
    """A worker process exited while the executor was running."""

    def __init__(self, rank: int, how: str, pid: int | None = None, title: str = "") -> None:
        name = f"pid {pid}, rayfree::{title}" if title else f"pid {pid}"
        super().__init__(
            f"worker rank {rank} ({name}) died ({how}); the executor has shut down. "
            f"Look at that worker's log for the cause."
        )
        self.rank = rank
        self.how = how


class RpcTimeout(ExecutorError, TimeoutError):
    """The RPC's deadline passed; the message lists the ranks that did not reply."""


class NotLeaderError(ExecutorError):
    """collective_rpc on a follower node: only the leader (node_rank_within_dp 0) broadcasts."""


class NodeLost(ExecutorFailed):
    """A follower node fell silent (killed, crashed, or its link cut), or stopped while the leader ran."""

    def __init__(self, node_rank: int, ranks: list[int], ip: str, why: str, replicas: list[int] | None = None) -> None:
        dp = f", DP replica {', '.join(map(str, replicas))}" if replicas else ""
        super().__init__(
            f"node {node_rank} ({ip}{dp}, ranks {ranks}) was lost: {why}; the executor has shut down. "
            f"Check that node's log and its network link to node 0."
        )
        self.node_rank = node_rank
        self.ranks = ranks
        self.replicas = replicas or []
        self.why = why


class LeaderLost(ExecutorFailed):
    """On a follower: the leader node fell silent, or stopped because something failed. (A node whose independent
    replicas each run on it alone serves on instead: node 0's replicas are lost, `ReplicaLost`.)"""

    def __init__(self, node_rank: int, why: str) -> None:
        super().__init__(f"node {node_rank}: the leader (node 0) is gone: {why}; this node stopped its workers")
        self.node_rank = node_rank


class ReplicaFailed(ExecutorFailed):
    """Another DP replica on this node failed: the replicas share one world (`replica_coupling="one-world"`), so
    this one stops too."""

    def __init__(self, dp_rank: int, why: str) -> None:
        super().__init__(
            f"DP replica {dp_rank} on this node failed ({why}); every replica stops with it, since "
            f"their ranks share one world (replica_coupling=one-world; with 'coupled' the others would serve on)"
        )
        self.dp_rank = dp_rank
        self.why = why


class ReplicaLost(ExecutorFailed):
    """An independent DP replica lost a node, a worker or a link: it alone stopped, the other replicas serve on
    (`replica_coupling`). Names the replica, the node, the ranks (across DP) and the cause; `cause` keeps the
    failure itself when this process saw it (a NodeLost, a WorkerDied, ...)."""

    def __init__(self, dp_rank: int, node_rank: int, ranks: list[int], why: str, cause: Exception | None = None):
        self.summary = f"node {node_rank}, ranks {ranks}: {why}"
        super().__init__(
            f"DP replica {dp_rank} was lost: {self.summary}; the other replicas serve on. "
            f"Route its requests to another replica; its nodes exit non-zero, for their launcher to replace them"
        )
        self.dp_rank = dp_rank
        self.node_rank = node_rank
        self.ranks = ranks
        self.why = why
        self.cause = cause


class ReplicaDrained(ReplicaLost):
    """An independent DP replica the operator drained (`rayfree drain`): its calls in flight finished, later ones
    are refused with this, and its nodes stopped cleanly (exit 0). A `ReplicaLost`, so an engine that routes
    around a lost replica routes around this one too; starting its nodes again brings it back (a rejoin)."""

    def __init__(self, dp_rank: int, node_rank: int, ranks: list[int], why: str = "drained by the operator"):
        super().__init__(dp_rank, node_rank, ranks, why)
        self.args = (
            f"DP replica {dp_rank} was drained ({why}); route its requests to another replica. Start its nodes "
            f"again with the same command to bring it back",
        )


class ReplicasChanged(ExecutorError):
    """Coupled DP replicas (`replica_coupling="coupled"`): the call met a change of the replicas that serve (one
    lost, drained or back) in a collective across replicas. The executor has not failed: the groups across
    replicas are formed again over `members` (membership `epoch`) before the next call goes out. Run it again."""

    def __init__(self, epoch: int, members: list[int], why: str) -> None:
        super().__init__(
            f"the DP replicas changed ({why}): the groups across replicas now span replicas {members} (membership "
            f"epoch {epoch}); run the call again"
        )
        self.epoch = epoch
        self.members = members


class WorkerStartupError(ExecutorError):
    """A worker could not start: it raised, died, or never became ready. Names its rank (and pid, title, exit)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message + (f"\n\nWorker traceback:\n{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback
        #: it reads like the fallout of a peer that went away (its cause is another rank's, maybe another node's)
        self.consequence = False


class StartupTimeout(WorkerStartupError, TimeoutError):
    """Workers did not become ready within ready_timeout_s (their stacks were dumped to their stderr)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message, ranks[0] if ranks else None)
        self.ranks = ranks


def failed_as(failure: BaseException | None, message: str) -> ExecutorFailed:
    """What a call raises once the executor has failed with `failure` (None: it was shut down): an error of
    the failure's own class when that is an `ExecutorFailed` (so `except NodeLost` works on every pending and
    later call), else a plain `ExecutorFailed`; its message is `message`, its cause the failure itself."""
    if failure is None:
        e = ExecutorFailed(message)
        e.__suppress_context__ = True  # the queue's own error says nothing more
        return e
    cls = type(failure) if isinstance(failure, ExecutorFailed) else ExecutorFailed
    out = cls.__new__(cls, message)  # the failure's attributes (rank, node_rank, ...) without its __init__
    out.__dict__.update(getattr(failure, "__dict__", {}))
    out.__cause__ = failure
    return out


# -- a rank's reply, as the caller's result or error ------------------------------------------------


def unreadable_reply(rank: int, e: Exception) -> RemoteError:
    return RemoteError(
        rank,
        type(e).__name__,
        f"its reply arrived but could not be read here: {e}",
        "(raised while unpickling the reply in the calling process)",
    )


def unwrap_error(r: RemoteError, name: str, fatal: bool = False) -> WorkerError:
    """The caller's error for a rank's exception; in a collective step (`fatal`) that also failed the executor,
    a FatalWorkerError, whichever of the reply and the rank's fatal report came first."""
    if fatal:
        return FatalWorkerError(
            r.rank,
            r.error_type,
            r.message,
            r.traceback,
            name,
            note="a collective step: the executor has stopped every worker",
        )
    return WorkerError(r.rank, r.error_type, r.message, r.traceback, name)


def unwrap(value: Any, name: str, fatal: bool = False) -> Any:
    """A RemoteError reply becomes the caller's WorkerError; a Boxed one gives back its value."""
    if type(value) is RemoteError:
        raise unwrap_error(value, name, fatal)
    return value.value
