"""`Executor`: what an engine calls; `UniProcExecutor`: the worker in the engine's own process."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from rayfree.cluster.config import ClusterConfig, require_config
from rayfree.transport import get_open_port
from rayfree.worker.messages import RemoteError
from rayfree.worker.proc import resolve_worker_cls

from .errors import ExecutorFailed, WorkerError
from .futures import FutureWrapper

__all__ = ["Executor", "UniProcExecutor", "FailureCallback", "ReplicaCallback", "ReplicaState"]

logger = logging.getLogger("rayfree.executor")

#: Called once when the executor fails (a worker died): the engine stops or restarts.
FailureCallback = Callable[[], None]


class ReplicaState(msgspec.Struct, frozen=True):
    """A DP replica as this process knows it: "serving"; "lost" (an independent replica; `why` says what it
    lost); "draining" (`rayfree drain`: route no new calls to it: one made anyway raises `ReplicaDrained` at once;
    its calls in flight finish) then "drained"
    (stopped; its nodes exited 0); or "rejoining" (node 0 admitted its replacement nodes). And its epoch (0,
    then one more at each rejoin)."""

    state: str
    epoch: int = 0
    why: str = ""


#: called with a DP replica's rank and its new state (on the node's policy thread: return quickly)
ReplicaCallback = Callable[[int, ReplicaState], None]


class Executor(ABC):
    """Runs a worker class on every rank of a cluster and calls its methods on all of them."""

    def __init__(
        self, config: ClusterConfig, worker_cls: type | str, worker_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Build the executor and start its worker(s).

        Args:
            config: the cluster's shape and timeouts (checked first: a wrong value is a `ConfigError` naming it).
            worker_cls: the worker class (a `rayfree.WorkerBase` subclass), or its import path ``"pkg.mod:Class"``.
            worker_kwargs: keyword arguments for the worker's constructor.
        """
        require_config(config)
        self.config = config
        self.parallel_config = config.parallel
        self.worker_cls = worker_cls
        self.worker_kwargs = dict(worker_kwargs or {})
        self.is_failed = False
        self.failure_callback: FailureCallback | None = None
        self._replica_callbacks: list[ReplicaCallback] = []
        #: set by an engine with a KV connector: execute_model's replies are then aggregated over every rank
        self.kv_output_aggregator: Any = None
        self._callback_lock = threading.Lock()
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
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
        """Call `method` on every worker.

        `method` is a worker method's name, or a callable taking the worker as
        its first argument (sent with cloudpickle). Returns one result when
        `unique_reply_rank` is given (only that rank replies), the aggregator's
        result when `aggregator` is given (every rank replies), else the list of
        every rank's result. `kv_output_aggregator` / `ec_output_aggregator` (vLLM's
        connectors' aggregators): every rank replies and the result is
        `agg.aggregate(outputs, output_rank=unique_reply_rank or 0)`. `non_block=True`
        returns a Future instead. `timeout` bounds the whole call (RpcTimeout).
        An exception in one of `config.collective_methods` (a collective step) is
        fatal: the executor fails and stops every worker.
        """

    @abstractmethod
    def shutdown(self) -> None: ...

    # -- the engine-facing step methods ---------------------------------------------

    @property
    def output_rank(self) -> int:
        """The rank whose output the engine reads (first TP rank of the last PP stage)."""
        return self.parallel_config.output_rank

    @property
    def max_concurrent_batches(self) -> int:
        pp = self.parallel_config.pipeline_parallel_size
        return pp if pp > 1 else (2 if self.config.async_scheduling else 1)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if self.kv_output_aggregator is not None:
            return self.collective_rpc(
                "execute_model",
                args=(scheduler_output,),
                unique_reply_rank=self.output_rank,
                non_block=non_block,
                timeout=self.config.rpc_timeout_s,
                kv_output_aggregator=self.kv_output_aggregator,
            )
        return self.collective_rpc(
            "execute_model",
            args=(scheduler_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=self.config.rpc_timeout_s,
        )

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        return self.collective_rpc(
            "sample_tokens",
            args=(grammar_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=self.config.rpc_timeout_s,
        )

    def execute_dummy_batch(self) -> None:
        self.collective_rpc(
            "execute_dummy_batch", unique_reply_rank=self.output_rank, timeout=self.config.rpc_timeout_s
        )

    def take_draft_token_ids(self) -> Any:
        return self.collective_rpc(
            "take_draft_token_ids", unique_reply_rank=self.output_rank, timeout=self.config.rpc_timeout_s
        )

    @property
    def response_mqs(self) -> list[Any]:
        """Every rank's reply queue, by rank (vLLM's name; empty where no queues are read)."""
        return []

    def get_response_mqs(self, unique_reply_rank: int = -1) -> list[Any]:
        """The reply queues, by rank (vLLM's accessor): every rank's (-1), or the one of `unique_reply_rank`."""
        if unique_reply_rank == -1:
            return list(self.response_mqs)
        if not isinstance(unique_reply_rank, int) or not 0 <= unique_reply_rank < len(self.response_mqs):
            raise ValueError(
                f"unique_reply_rank={unique_reply_rank!r} is not a rank with a reply queue here "
                f"(0..{len(self.response_mqs) - 1}, or -1 for all)"
            )
        return [self.response_mqs[unique_reply_rank]]

    def check_health(self) -> None:
        timeout = self.config.rpc_timeout_s
        self.collective_rpc("check_health", timeout=10.0 if timeout is None else min(10.0, timeout))

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call `callback` once when the executor fails; at once if it already has."""
        with self._callback_lock:
            if not self.is_failed:
                self.failure_callback = callback
                return
        callback()

    def fire_failure_callback(self) -> None:
        """The engine's failure callback, once (the node's policy calls it before pending calls raise)."""
        with self._callback_lock:
            callback, self.failure_callback = self.failure_callback, None
        if callback is not None:
            callback()

    def replica_states(self) -> dict[int, ReplicaState]:
        """Every DP replica's state, for an engine that routes requests around a lost one. With independent or
        coupled replicas (`replica_coupling`) node 0 hears of every loss and tells every node; with one world a
        loss fails every replica, so this executor's own failure says it all."""
        lv = self._node_liveness()
        if lv is not None:
            states: dict[int, ReplicaState] = lv.replica_epochs.states()
            return states
        return {k: ReplicaState("serving") for k in range(self.parallel_config.data_parallel_size)}

    def replica_widths(self) -> tuple[int, int, int]:
        """(requested, serving, membership epoch): the DP width asked for (`scale_replicas`, `rayfree scale`),
        how many replicas take calls now, and the epoch of their membership, as this node knows them (node 0
        decides; a follower hears of losses, returns and, with coupled replicas, each epoch)."""
        lv = self._node_liveness()
        if lv is None:
            return self.parallel_config.data_parallel_size, self.parallel_config.data_parallel_size, 0
        r = lv.replica_epochs.roster
        return int(r.requested), int(r.effective), int(r.epoch)

    def scale_replicas(self, width: int) -> str:
        """Node 0: ask for `width` DP replicas, as `rayfree scale --dp` does: the highest replicas drain (their
        calls in flight finish, their nodes exit 0), or replicas below `width` are taken when their nodes start
        (again, or past the --dp the cluster started with: docs/operations.md). One line: what begins, or why
        not (it starts with "refused")."""
        lv = self._node_liveness()
        if lv is None or self.parallel_config.node_rank != 0 or lv.par.data_parallel_size == 1:
            return "refused: only node 0 of a cluster of DP replicas with worlds of their own scales it"
        return str(lv.scale(width))

    def register_replica_callback(self, callback: ReplicaCallback) -> None:
        """Call `callback(dp_rank, state)` whenever a DP replica's state changes: lost, serving again."""
        self._replica_callbacks.append(callback)

    def fire_replica_callbacks(self, dp_rank: int, state: ReplicaState) -> None:
        """The node's policy thread: replica `dp_rank` is in `state` now."""
        for callback in list(self._replica_callbacks):
            try:
                callback(dp_rank, state)
            except Exception:  # noqa: BLE001 - the engine's callback must not stop the failure's handling
                logger.exception("a replica callback raised")

    def _node_liveness(self) -> Any:
        return getattr(self, "liveness", None)  # (the node's NodeLiveness, where there is one)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class UniProcExecutor(Executor):
    """The worker runs in this process (world size 1): no queues, no children. For tests and tiny models."""

    def _init_executor(self) -> None:
        if self.parallel_config.world_size != 1 or self.parallel_config.nnodes != 1:
            raise ValueError(
                f"UniProcExecutor runs one rank on one node; this config has world size "
                f"{self.parallel_config.world_size} on {self.parallel_config.nnodes} node(s): use "
                f"MultiprocExecutor"
            )
        cls = resolve_worker_cls(self.worker_cls)
        method = f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}"
        self.worker = cls(self.config, 0, 0, method, True, **self.worker_kwargs)
        self.worker.init_device()
        self.worker.load_model()
        self._futures: deque[FutureWrapper] = deque()
        self._lock = threading.RLock()
        self._closed = False

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
        if self._closed:
            raise ExecutorFailed("the executor was shut down")
        connector = kv_output_aggregator if kv_output_aggregator is not None else ec_output_aggregator
        if connector is not None:
            aggregator = lambda outputs: connector.aggregate(outputs, output_rank=0)  # noqa: E731
        try:
            if isinstance(method, str):
                value: Any = getattr(self.worker, method)(*args, **(kwargs or {}))
            else:
                value = method(self.worker, *args, **(kwargs or {}))
            error = None
        except Exception as e:  # noqa: BLE001 - delivered like a worker's failure
            error = RemoteError.of(0, e)

        def collect(deadline: float | None) -> Any:
            if error is not None:
                raise WorkerError(
                    0, error.error_type, error.message, error.traceback, method if isinstance(method, str) else ""
                )
            if aggregator is not None:
                return aggregator([value])
            return value if unique_reply_rank is not None else [value]

        fut = FutureWrapper(self._futures, self._lock, collect)
        return fut if non_block else fut.result()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.worker.shutdown()
        finally:
            from rayfree.cluster.parallel_state import destroy_distributed_environment

            destroy_distributed_environment()
