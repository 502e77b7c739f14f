"""`NodeReplicas`: the DP replicas one node runs, started together and stopped together.

With data parallelism every replica's ranks join one torch.distributed world,
so no replica becomes ready alone: the executors of a node that holds several
replicas (DP >= nnodes) are started side by side, each in its own thread, with
one `NodeLiveness` between them. A node that leads a replica runs the
engine's entry point with that replica's executor (its `dp_rank` says which);
a follower node of a replica that spans nodes only serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from rayfree.cluster.config import ClusterConfig
from rayfree.supervisor import supervisor

from .errors import ReplicaDrained
from .liveness import NodeLiveness, for_node
from .multiproc import MultiprocExecutor

__all__ = ["NodeReplicas"]

logger = logging.getLogger("rayfree.executor")

#: How often the waiting thread wakes to let a signal handler run.
_WAKE_S = 0.5


class NodeReplicas:
    """The executors of every DP replica this node runs, started together and sharing one liveness (their ranks
    share collectives, so one failing stops them all); the first start-up failure is raised after the rest are
    stopped."""

    def __init__(
        self,
        config: ClusterConfig,
        worker_cls: Any,
        worker_kwargs: dict[str, Any] | None = None,
        on_liveness: Callable[[NodeLiveness], None] | None = None,
    ) -> None:
        """Start this node's replicas; returns once every one is ready.

        Args:
            config: the cluster's shape and timeouts (each replica gets it with its own `data_parallel_rank`).
            worker_cls: the worker class, or its import path ``"pkg.mod:Class"``.
            worker_kwargs: keyword arguments for the worker's constructor (picklable).
            on_liveness: called with the node's liveness before any executor starts (to serve metrics from it).
        """
        par = config.parallel
        self.config = config
        self.dp_ranks = par.node_replicas
        self.liveness = for_node(config, len(self.dp_ranks))
        if on_liveness is not None:
            on_liveness(self.liveness)
        self.executors: list[MultiprocExecutor] = []
        # a follower's independent replicas start in the epoch node 0 gives (a later one when they rejoin)
        try:
            epochs = self.liveness.welcome_epochs(config.join_timeout_s) if self.liveness.independent else {}
        except BaseException:  # (refused by node 0: a replacement of another shape)
            self.liveness.close()
            raise
        configs = [
            msgspec.structs.replace(
                config,
                parallel=msgspec.structs.replace(par, data_parallel_rank=r, replica_epoch=epochs.get(r, 0)),
            )
            for r in self.dp_ranks
        ]
        try:
            self._start(configs, worker_cls, worker_kwargs)
        except BaseException:
            self.liveness.close()  # its goodbye said (late followers told, bounded) before the node leaves
            raise

    def _start(self, configs: list[ClusterConfig], worker_cls: Any, worker_kwargs: dict[str, Any] | None) -> None:
        if len(configs) == 1:
            self.executors = [MultiprocExecutor(configs[0], worker_cls, worker_kwargs, liveness=self.liveness)]
            return
        made: dict[int, MultiprocExecutor] = {}
        errors: dict[int, BaseException] = {}

        def start(i: int) -> None:
            try:
                made[i] = MultiprocExecutor(configs[i], worker_cls, worker_kwargs, liveness=self.liveness)
            except BaseException as e:  # noqa: BLE001 - reported below, after the others are stopped
                errors[i] = e
                self.liveness.fail_all(e if isinstance(e, Exception) else RuntimeError(f"start-up interrupted: {e!r}"))

        threads = [
            supervisor().start(f"RayfreeStartReplica-{r}", start, args=(i,)) for i, r in enumerate(self.dp_ranks)
        ]
        try:
            for t in threads:
                while t.alive():
                    t.wait(_WAKE_S)
        except BaseException:  # a signal while starting: the executors still starting fail on their own
            self.liveness.fail_all(RuntimeError("start-up interrupted"))
            raise
        finally:
            self.executors = [made[i] for i in sorted(made)]
        if errors:
            self.shutdown()
            raise errors[min(errors)]

    @property
    def leaders(self) -> list[MultiprocExecutor]:
        """The executors that broadcast (this node leads their replica)."""
        return [ex for ex in self.executors if ex.is_leader]

    def run(self, entry: Callable[[MultiprocExecutor], Any]) -> list[Any]:
        """Call `entry(ex)` for every replica this node leads (side by side when there are several) and return
        what each returned; an exception is returned in its place."""
        leaders = self.leaders
        if len(leaders) == 1:
            return [self._call(entry, leaders[0])]
        results: list[Any] = [None] * len(leaders)

        def call(i: int) -> None:
            results[i] = self._call(entry, leaders[i])

        threads = [supervisor().start(f"RayfreeEntry-{ex.dp_rank}", call, args=(i,)) for i, ex in enumerate(leaders)]
        for t in threads:
            while t.alive():
                t.wait(_WAKE_S)
        return results

    @staticmethod
    def _call(entry: Callable[[MultiprocExecutor], Any], ex: MultiprocExecutor) -> Any:
        try:
            return entry(ex)
        except Exception as e:  # noqa: BLE001 - the caller turns it into an exit code
            logger.error("DP replica %d: the entry point raised %s: %s", ex.dp_rank, type(e).__name__, e)
            logger.debug("traceback", exc_info=True)
            return e

    def finish(self) -> bool:
        """The entries have returned: wait until the whole cluster may stop; False if it failed instead."""
        return self.liveness.finish()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Until every executor of this node has shut down (a follower node's whole life)."""
        return all(ex.wait_done(timeout) for ex in self.executors)

    @property
    def failure(self) -> Exception | None:
        """The node's failure, else an executor's (a drained replica's stop is none)."""
        return self.liveness.failure or next(
            (ex.failure for ex in self.executors if ex.failure and not isinstance(ex.failure, ReplicaDrained)), None
        )

    def drain(self, dp_rank: int) -> str:
        """Node 0: drain DP replica `dp_rank` as `rayfree drain` does (drain.py); one line: begun, or why not."""
        from . import drain

        if self.config.parallel.node_rank != 0:
            return "refused: only node 0 drains a replica"
        return drain.request(self.liveness, dp_rank)

    def scale(self, width: int) -> str:
        """Node 0: ask for `width` DP replicas as `rayfree scale --dp` does (drain.py); one line."""
        if self.config.parallel.node_rank != 0:
            return "refused: only node 0 scales the cluster"
        return self.liveness.scale(width)

    def shutdown(self) -> None:
        for ex in self.executors:
            ex.shutdown()
        self.liveness.close()  # the heartbeats say their goodbye and end
