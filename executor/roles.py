"""The two faces the membership's code sees: an executor as the node's failure policy, the roster's door and
the drains act on it (`PolicyExecutor`), and the node they act for (`Node`). Typed Protocols, so an editor
follows a failure through every hop from the thread that noticed it to the executors it fails, and the policy
(failure_policy.py), the membership (rejoin.py, drain.py, membership.py) and liveness depend on no class's
insides. `MultiprocExecutor` is a `PolicyExecutor`, `NodeLiveness` a `Node`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .view import ReplicaView

if TYPE_CHECKING:
    from rayfree.cluster.config import ClusterConfig, ParallelConfig
    from rayfree.cluster.heartbeat import HeartbeatServer
    from rayfree.cluster.heartbeat_client import HeartbeatClient
    from rayfree.supervisor import Failure, Severity, Supervisor

    from .abstract import ReplicaState
    from .errors import ReplicaLost
    from .roster import Decision, Event, Roster
    from .rpc import RpcPipe
    from .workers import WorkerGroup

__all__ = ["PolicyExecutor", "Node", "Policy", "Door"]


class PolicyExecutor(ReplicaView, Protocol):
    """One DP replica's executor as the node's policy, drains and membership act on it."""

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def liveness(self) -> Node | None: ...

    @property
    def pipe(self) -> RpcPipe | None:
        """The leader's queues and calls (None on a follower, and before start-up made them)."""

    @property
    def group(self) -> WorkerGroup | None: ...

    @property
    def starting(self) -> bool: ...

    @property
    def shutting_down(self) -> bool: ...

    @property
    def is_failed(self) -> bool: ...

    @property
    def severity(self) -> Severity: ...

    @property
    def done(self) -> bool:
        """Its entry's work is over (a clean stop may follow)."""

    @property
    def stop_reason(self) -> str:
        """Why it stops ("": a clean stop)."""

    def mark_failed(self, cause: Exception | None, severity: Severity) -> None: ...

    def mark_done(self) -> None: ...

    def abort_startup(self) -> None: ...

    def begin_shutdown(self) -> bool: ...

    def release(self) -> None: ...

    def wait_done(self, timeout: float | None = None) -> bool: ...

    def fire_failure_callback(self) -> None: ...

    def fire_replica_callbacks(self, dp_rank: int, state: ReplicaState) -> None: ...


class Policy(Protocol):
    """A node's failure policy (failure_policy.NodePolicy): every failure goes in by `report`, from any thread."""

    sup: Supervisor

    @property
    def lost(self) -> dict[int, ReplicaLost]: ...

    def report(self, source: str, cause: Exception | None, executor: PolicyExecutor | None = None) -> None: ...

    def failure(self, source: str, cause: Exception | None, executor: PolicyExecutor | None = None) -> Failure: ...

    def apply(self, f: Failure) -> None: ...


class Door(Protocol):
    """The one way into a node's roster (rejoin.ReplicaEpochs): events in, decisions out, carried out."""

    roster: Roster

    def send(self, ev: Event, act: bool = True) -> list[Decision]: ...

    def act(self, decisions: list[Decision]) -> None: ...

    def drains(self, k: int) -> bool: ...


class Node(Protocol):
    """One node's liveness as its policy, its membership (the roster's door) and the drains use it."""

    config: ClusterConfig
    par: ParallelConfig
    node: int
    independent: bool
    #: coupled DP replicas: the membership epoch and the replicas in it
    membership: tuple[int, list[int]]
    stop_requested: str
    stopped_cleanly: str
    settled: threading.Event

    @property
    def beater(self) -> HeartbeatServer | HeartbeatClient | None: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def replica_epochs(self) -> Door: ...

    @property
    def owner(self) -> Any: ...

    def executors(self) -> list[PolicyExecutor]: ...

    def nodes(self) -> list[int]: ...

    def lost_nodes(self) -> set[int]: ...

    def verdict_s(self) -> float: ...

    def stopping(self, ex: PolicyExecutor) -> None: ...

    def failed(self, f: Failure) -> None: ...

    def close_steps(self) -> Iterator[float]: ...
