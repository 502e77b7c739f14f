"""What `collective_rpc` and the executor raise; each names the rank(s) concerned."""

from __future__ import annotations

__all__ = ["ExecutorError", "WorkerError", "WorkerDied", "RpcTimeout", "ExecutorFailed", "NotLeaderError",
           "NodeLost", "LeaderLost", "ReplicaFailed", "WorkerStartupError", "StartupTimeout"]


class ExecutorError(RuntimeError):
    """Base of the executor's errors."""


class WorkerError(ExecutorError):
    """A worker's method raised: its rank, exception type, message and the worker's traceback."""

    def __init__(self, rank: int, error_type: str, message: str, remote_traceback: str, method: str = "",
                 note: str = "") -> None:
        where = f" in {method}" if method else ""
        super().__init__(f"worker rank {rank} raised {error_type}{where}: {message}"
                         + (f" ({note})" if note else "") + f"\n\nWorker traceback (rank {rank}):\n{remote_traceback}")
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback


class WorkerDied(ExecutorError):
    """A worker process exited while the executor was running."""

    def __init__(self, rank: int, how: str, pid: int | None = None, title: str = "") -> None:
        name = f"pid {pid}, rayfree::{title}" if title else f"pid {pid}"
        super().__init__(f"worker rank {rank} ({name}) died ({how}); the executor has shut down. "
                         f"Look at that worker's log for the cause.")
        self.rank = rank
        self.how = how


class RpcTimeout(ExecutorError, TimeoutError):
    """The RPC's deadline passed; the message lists the ranks that did not reply."""


class ExecutorFailed(ExecutorError):
    """The executor failed earlier (a worker died) or was shut down; it takes no more calls."""


class NotLeaderError(ExecutorError):
    """collective_rpc on a follower node: only the leader (node_rank_within_dp 0) broadcasts."""


class NodeLost(ExecutorError):
    """A follower node fell silent (killed, crashed, or its link cut), or stopped while the leader ran."""

    def __init__(self, node_rank: int, ranks: list[int], ip: str, why: str, replicas: list[int] | None = None
                 ) -> None:
        dp = f", DP replica {', '.join(map(str, replicas))}" if replicas else ""
        super().__init__(f"node {node_rank} ({ip}{dp}, ranks {ranks}) was lost: {why}; the executor has shut down. "
                         f"Check that node's log and its network link to node 0.")
        self.node_rank = node_rank
        self.ranks = ranks
        self.replicas = replicas or []


class LeaderLost(ExecutorError):
    """On a follower: the leader node fell silent, or stopped because something failed."""

    def __init__(self, node_rank: int, why: str) -> None:
        super().__init__(f"node {node_rank}: the leader (node 0) is gone: {why}; this node stopped its workers")
        self.node_rank = node_rank


class ReplicaFailed(ExecutorError):
    """Another DP replica on this node failed: the replicas share collectives, so this one stops too."""

    def __init__(self, dp_rank: int, why: str) -> None:
        super().__init__(f"DP replica {dp_rank} on this node failed ({why}); every replica stops with it, since "
                         f"their ranks share collectives (DP, expert parallel)")
        self.dp_rank = dp_rank


class WorkerStartupError(ExecutorError):
    """A worker could not start: it raised, died, or never became ready. Names its rank (and pid, title, exit)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message + (f"\n\nWorker traceback:\n{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback


class StartupTimeout(WorkerStartupError, TimeoutError):
    """Workers did not become ready within ready_timeout_s (their stacks were dumped to their stderr)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message, ranks[0] if ranks else None)
        self.ranks = ranks
