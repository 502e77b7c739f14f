"""The error names what happened: a death that races a survivor's collective error is reported as the death,
stuck ranks are stopped at once after a fatal step, and the failure callback has run before a pending call
raises. Real gloo worlds, both paths (shm and tcp) where both apply."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rayfree.cluster.config import ClusterConfig
from rayfree.executor import ExecutorFailed, FatalWorkerError, MultiprocExecutor, WorkerDied
from rayfree.procs import is_alive
from tests.support.config import cfg as base_cfg
from tests.support.paths import pythonpath
from tests.support.waits import wait_until

ECHO = "tests.support.sample_workers:EchoWorker"
STEPS = ["execute_model", "allreduce_for", "fail_while_peers_wait", "step_fail_then_allreduce"]


@pytest.fixture(params=["shm", "tcp"])
def path(request) -> str:
    return request.param


DEFAULT = ClusterConfig()


def cfg(path: str, tp: int = 2, **kw) -> ClusterConfig:
    """The tests' config with STEPS as the collective steps, and the default staged shutdown."""
    kw.setdefault("collective_methods", STEPS)
    kw.setdefault("shutdown_grace_s", DEFAULT.shutdown_grace_s)
    kw.setdefault("shutdown_term_s", DEFAULT.shutdown_term_s)
    return base_cfg(path, tp, **kw)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_worker_sigkilled_mid_step_is_reported_as_its_death_not_as_the_survivors_broken_collective(
    path: str, victim: int, capfd, tmp_path
) -> None:
    """Every rank is inside all-reduces; one is SIGKILLed. The survivor's gloo error ("Connection closed by
    peer") reaches the caller as its reply at about the moment the death does: the pending call, and every later
    one, raise WorkerDied naming the killed rank, three times in a row; the survivor's traceback is not logged
    as an error."""
    for i in range(3):
        ex = MultiprocExecutor(cfg(path), ECHO, {"distributed": True})
        try:
            pids = [w.proc.pid for w in ex.workers]
            marks = tmp_path / str(i)
            marks.mkdir()
            pending = ex.collective_rpc(
                "allreduce_for", args=(60.0, str(marks)), unique_reply_rank=1 - victim, non_block=True
            )
            wait_until(lambda m=marks: len(os.listdir(m)) == 2, 30, "both ranks inside the all-reduces")
            os.kill(pids[victim], signal.SIGKILL)
            with pytest.raises(WorkerDied) as info:
                pending.result(timeout=30)
            assert info.value.rank == victim and f"worker rank {victim} " in str(info.value), str(info.value)
            assert "died (signal SIGKILL)" in str(info.value)
            with pytest.raises(WorkerDied):
                ex.collective_rpc("echo", args=(1,), timeout=10)
            assert isinstance(ex.failure, WorkerDied) and ex.failure.rank == victim
        finally:
            ex.shutdown()
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert not [line for line in errors if "closed by peer" in line.lower() or "Traceback" in line], errors
    assert not [line for line in err.splitlines() if line.startswith("Traceback")], err[-3000:]


@pytest.mark.timeout(120)
def test_a_survivors_broken_collective_names_the_rank_that_raised_not_the_survivor(path: str) -> None:
    """Rank 1 raises in a collective step; rank 0, the reply rank, breaks in its all-reduce because rank 1 left:
    the call raises rank 1's FatalWorkerError (its message and traceback), not rank 0's connection error."""
    ex = MultiprocExecutor(cfg(path), ECHO, {"distributed": True})
    try:
        with pytest.raises(FatalWorkerError) as info:
            ex.collective_rpc("step_fail_then_allreduce", args=(1,), unique_reply_rank=0, timeout=60)
        text = str(info.value)
        assert "worker rank 1 raised RuntimeError in step_fail_then_allreduce" in text, text
        assert "broke before the all-reduce" in text and "closed by peer" not in text.lower(), text
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_after_a_fatal_step_ranks_stuck_in_a_collective_are_stopped_at_once(path: str) -> None:
    """TP=3: rank 2 raises in a collective step while rank 1 waits in a native receive that will never complete
    (its Python signal handlers cannot run there) and rank 0 sleeps. Once the step has failed, every worker is
    gone within a second: the staged close does not give the stuck rank a grace it cannot use (with the grace
    and SIGTERM stage of an orderly stop, SIGKILL came 1.2 s after)."""
    ex = MultiprocExecutor(cfg(path, tp=3, shutdown_grace_s=5, shutdown_term_s=5), ECHO, {"distributed": True})
    try:
        pids = [w.proc.pid for w in ex.workers]
        with pytest.raises(FatalWorkerError, match="rank 2 broke while the others waited"):
            ex.collective_rpc("fail_while_peers_wait", args=(2, 1), unique_reply_rank=2, timeout=60)
        t0 = time.monotonic()
        took = wait_until(lambda: not any(is_alive(p) for p in pids), 10, "every worker gone")
        assert took < 1.0, f"a worker was still alive {took:.2f}s after the step failed"
        assert time.monotonic() - t0 < 10
    finally:
        ex.shutdown()


@pytest.mark.timeout(360)  # ten cold starts: 12-17 s each beside a second suite on two cores
@pytest.mark.parametrize("how", ["worker killed", "fatal step"])
def test_the_failure_callback_has_run_when_a_pending_call_raises(how: str) -> None:
    """The callback runs on the node's policy thread, and every pending call raises only after it returned: five
    times each way."""
    for _ in range(5):
        ex = MultiprocExecutor(cfg("shm"), ECHO, {"distributed": True})
        try:
            seen: list[str] = []
            ex.register_failure_callback(lambda s=seen: s.append(threading.current_thread().name))
            pids = [w.proc.pid for w in ex.workers]
            if how == "worker killed":
                pending = ex.collective_rpc("sleep", args=(60,), non_block=True)
                os.kill(pids[1], signal.SIGKILL)
            else:
                pending = ex.collective_rpc("execute_model", args=({"fail_rank": 1},), non_block=True)
            with pytest.raises(ExecutorFailed):
                pending.result(timeout=30)
            assert seen, "the pending call raised before the failure callback ran"
            assert seen == ["RayfreePolicy"], seen  # the node's policy thread, before the call raised
        finally:
            ex.shutdown()


UNGUARDED = """
from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.executor import MultiprocExecutor
ex = MultiprocExecutor(ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2)), "{worker}")
ex.shutdown()
"""


@pytest.mark.timeout(120)
def test_an_engine_script_without_a_main_guard_is_told_so(tmp_path) -> None:
    """Spawn re-runs the engine's main module in every worker; without `if __name__ == "__main__":` each worker
    would start an executor of its own. The start-up error says that, naming the script, instead of a bare
    "died before becoming ready (exit code 1)" with the cause only in the workers' stderr."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(UNGUARDED.format(worker=ECHO))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": pythonpath(root)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rayfree.executor.errors.WorkerStartupError: worker rank"), r.stderr[-3000:]
    assert f"re-ran {script}" in last and 'if __name__ == "__main__":' in last, last


@pytest.mark.timeout(30)
def test_a_failure_is_weighed_by_its_cause_type() -> None:
    """One table says how each failure is handled (`severity_of`): the reporters name the cause, never the
    weight. A subclass weighs as its class (a drained replica is a planned stop, not a loss)."""
    from rayfree import CallInterrupted, LeaderLost, NodeLost, ReplicaDrained, ReplicaLost
    from rayfree.executor.failure_policy import severity_of
    from rayfree.supervisor import Severity, ThreadCrashed

    table = [
        (None, Severity.STOP),
        (CallInterrupted("RPC x was interrupted"), Severity.CALLER),
        (WorkerDied(1, "signal SIGKILL", 42, "w"), Severity.WORKER),
        (ReplicaDrained(1, 1, [1]), Severity.WORKER),
        (ReplicaLost(1, 1, [1], "killed"), Severity.FATAL),
        (NodeLost(1, [1], "10.0.0.2", "silent"), Severity.FATAL),
        (LeaderLost(1, "silent"), Severity.FATAL),
        (FatalWorkerError(0, "RuntimeError", "boom", ""), Severity.FATAL),
        (ThreadCrashed("RayfreeHeartbeatServer", KeyError("x")), Severity.FATAL),
        (RuntimeError("anything else"), Severity.FATAL),
    ]
    assert [severity_of(cause) for cause, _ in table] == [weight for _, weight in table]
    assert isinstance(CallInterrupted("x"), ExecutorFailed)  # (`except ExecutorFailed` catches it, as before)


@pytest.mark.timeout(60)
def test_the_failure_policy_runs_only_on_its_thread_and_is_reached_from_others_by_report() -> None:
    """The policy's state has no lock: `apply` from any thread but the policy's is refused (SupervisorMisuse) and
    changes nothing; `report` is the door, and what it posts is applied on the policy thread."""
    from rayfree.supervisor import SupervisorMisuse

    with MultiprocExecutor(cfg("shm", tp=1), ECHO) as ex:
        policy = ex.liveness.policy
        with pytest.raises(SupervisorMisuse, match="runs on the policy thread"):
            policy.apply(policy.failure("a test", RuntimeError("boom"), ex))
        assert not ex.is_failed and policy.record is None
        assert ex.collective_rpc("echo", args=(1,), timeout=30) == [1]
        policy.report("a test", RuntimeError("boom"), ex)
        wait_until(lambda: ex.is_failed, 30, "the failure reported to be applied")
        assert policy.record is not None and "boom" in str(policy.record.cause)
