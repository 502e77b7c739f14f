"""What the node's liveness, the stall watch, status and metrics need of an executor: a small typed face.

They hold a `ReplicaView` (a `MultiprocExecutor` is one) and never its
private state; the executor keeps start-up, its failure policy and shutdown
to itself.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from rayfree.cluster.config import ParallelConfig

from .workers import WorkerHandle

__all__ = ["ReplicaView", "RpcSnapshot"]


class RpcSnapshot(msgspec.Struct):
    """What a look from another thread sees of a leader's RPC pipe (racy by design)."""

    #: (method, age in seconds, ranks whose replies are still awaited, its start), oldest first
    calls: list[tuple[str, float, list[int], float]]
    #: seconds since each rank's last reply (None: none yet)
    since_reply_s: list[float | None]
    failures: int
    #: the broadcast queue's view: bytes per path; ring chunks, occupied, behind per local reader
    ring: dict[str, Any]
    #: per method: call counts per latency bucket (not cumulative) and their sum, once latencies are recorded
    latency: dict[str, tuple[list[int], float]]


class ReplicaView(Protocol):
    """One DP replica's executor on this node, as the node's machinery sees it."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def parallel_config(self) -> ParallelConfig: ...

    @property
    def failure(self) -> Exception | None:
        """Why it failed (None while it runs, or after a clean shutdown)."""

    @property
    def stopped(self) -> bool:
        """It is shutting down or has failed: no more reports about it."""

    @property
    def workers(self) -> list[WorkerHandle]: ...

    def rpc_snapshot(self) -> RpcSnapshot | None:
        """The leader's calls in flight, replies and ring (None on a follower, or once closed)."""

    def relay_status(self) -> dict[str, Any]:
        """A follower node's relay: messages and bytes relayed, bytes passed on, its ring (empty: no relay)."""

    def relays_seen(self) -> dict[int, list[Any]]:
        """Node 0: each follower node's relays (status.RelayStatus) as its last heartbeat told, by node."""

    def dump_stacks(self, ranks: list[int]) -> None:
        """Have these local ranks log their Python stacks."""

    def record_latencies(self) -> None:
        """From now on keep each call's latency (someone serves metrics)."""

    def shutdown(self) -> None: ...
