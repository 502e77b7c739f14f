"""A follower node whose ranks see node 0's close before node 0's goodbye reaches the node (two connections,
no order between them): the ranks leave with an exit code, the node's policy holds that death for the
heartbeats' verdict, and the verdict is node 0's clean stop. The node then stops cleanly, not failed.

The policy and the heartbeats are real (a real node 0 heartbeat server on loopback); the executor is a
stand-in with only the face the policy uses, so the order of the two events is the test's to choose."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.cluster.heartbeat import Bye, HeartbeatServer
from rayfree.executor.errors import WorkerDied
from rayfree.executor.liveness import for_node
from rayfree.supervisor import Severity
from rayfree.transport import get_open_port


class _Replica:
    """What the node's policy touches of an executor, and no more."""

    dp_rank = 0
    starting = False
    group = None
    pipe = None
    stop_reason = ""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.failure: Exception | None = None
        self.is_failed = self.shutting_down = False
        self.severity = Severity.STOP
        self.released = threading.Event()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def begin_shutdown(self) -> bool:
        first, self.shutting_down = not self.shutting_down, True
        return first

    def mark_failed(self, cause: Exception | None, severity: Severity) -> None:
        self.failure, self.is_failed, self.severity = cause, True, max(self.severity, severity)

    def fire_failure_callback(self) -> None:
        pass

    def release(self) -> None:
        self.released.set()

    def mark_done(self) -> None:
        self._done.set()


def _until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("goodbye", ["clean", "failed"])
def test_a_rank_death_held_for_the_verdict_is_no_failure_when_node_0_stopped_cleanly(goodbye: str, caplog) -> None:
    port = get_open_port("127.0.0.1")
    par = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port)
    config = ClusterConfig(parallel=par, heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0, heartbeat_port=port)
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 5.0, lambda *a: None)
    server.start()
    lv = for_node(config)
    ex = _Replica(config)
    try:
        lv.attach(ex)  # type: ignore[arg-type]
        lv.ready()
        assert lv.beater is not None and lv.beater.contact.wait(20), "node 0 never answered"
        with caplog.at_level(logging.INFO, logger="rayfree.executor"):
            # the close came first: rank 1 left with an exit code; the policy holds it for the verdict ...
            lv.policy.report("worker rank 1", WorkerDied(1, "exit code 1", 4242, "w"), ex)
            _until(lambda: "waiting up to" in caplog.text, 20, "the death was not held for the verdict")
            # ... which is node 0's goodbye, read before the hold ends (it is never shorter than a suspect window)
            server.close(Bye(0, goodbye == "clean", "shut down" if goodbye == "clean" else "rank 0 died"), 20)
            _until(lambda: ex.done, 20, "the node never stopped its executor")
            _until(lambda: "came with node 0's clean stop" in caplog.text or lv.failure is not None, 20, "no verdict")
        if goodbye == "clean":
            assert lv.failure is None and not ex.is_failed, lv.failure
        else:
            assert lv.failure is not None and "rank 0 died" in str(lv.failure), lv.failure
    finally:
        lv.close(10)
        server.close(timeout=10)
