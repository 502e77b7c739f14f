"""MultiprocExecutor and UniProcExecutor with real worker processes."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rayfree.cli.toy_engine import make_batch, reference_forward
from rayfree.executor import (
    ExecutorFailed,
    MultiprocExecutor,
    RpcTimeout,
    StartupTimeout,
    UniProcExecutor,
    WorkerError,
    WorkerStartupError,
)
from rayfree.procs import is_alive
from tests.support.config import cfg
from tests.support.waits import wait_until

ECHO = "tests.support.sample_workers:EchoWorker"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def echo2():
    ex = MultiprocExecutor(cfg(), ECHO, {"tag": "x", "nested": {"a": [1, 2]}})
    try:
        yield ex
    finally:
        ex.shutdown()


alive = is_alive


def wait_dead(pids, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


# -- RPC shapes -----------------------------------------------------------------------


def test_all_replies_unique_reply_and_aggregation(echo2) -> None:
    everyone = echo2.collective_rpc("whoami")
    assert [w["rank"] for w in everyone] == [0, 1]
    assert [w["driver"] for w in everyone] == [True, False]
    assert all(w["kwargs"] == {"tag": "x", "nested": {"a": [1, 2]}} for w in everyone)  # passed through untouched
    assert echo2.collective_rpc("whoami", unique_reply_rank=1)["rank"] == 1
    assert echo2.collective_rpc("whoami", aggregator=lambda rs: sorted(r["rank"] for r in rs)) == [0, 1]
    assert echo2.execute_model({"s": 1}) == ("executed", echo2.output_rank, {"s": 1})


def test_a_callable_travels_with_cloudpickle(echo2) -> None:
    k = 10
    assert echo2.collective_rpc(lambda w, m: (w.rank + 1) * m * k, args=(2,)) == [20, 40]


def test_non_blocking_futures_resolve_in_call_order_when_waited_out_of_order(echo2) -> None:
    f1 = echo2.collective_rpc("echo", args=(1,), non_block=True)
    f2 = echo2.collective_rpc("sleep", args=(0.3,), non_block=True)
    f3 = echo2.collective_rpc("echo", args=(3,), unique_reply_rank=0, non_block=True)
    assert f3.result(timeout=30) == 3
    assert f1.done() and f2.done()
    assert f1.result() == [1, 1] and f2.result() == [0, 1]


def test_future_result_timeout_leaves_the_call_pending(echo2) -> None:
    f = echo2.collective_rpc("sleep", args=(1.0,), non_block=True)
    t0 = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.1)
    assert time.monotonic() - t0 < 0.5 and not f.done()
    assert f.result(timeout=30) == [0, 1]


def test_rpc_timeout_names_the_ranks_that_did_not_reply_and_late_replies_are_not_misread(echo2) -> None:
    t0 = time.monotonic()
    with pytest.raises(RpcTimeout, match=r"rank\(s\) \[1\] have not replied"):
        echo2.collective_rpc("sleep", args=(1.5,), kwargs={"only_rank": 1}, timeout=0.3)
    assert time.monotonic() - t0 < 1.0
    # rank 1's late reply to the timed-out call must not be taken as the answer to this one
    assert echo2.collective_rpc("echo", args=("fresh",), timeout=30) == ["fresh", "fresh"]
    # the same through the engine's step path (one reply)
    with pytest.raises(RpcTimeout, match=r"rank\(s\) \[1\] have not replied"):
        echo2.collective_rpc("sleep", args=(1.5,), unique_reply_rank=1, timeout=0.3)
    assert echo2.collective_rpc("echo", args=("fresh",), unique_reply_rank=1) == "fresh"
    assert echo2.collective_rpc("echo", args=("fresh",), unique_reply_rank=1, timeout=30) == "fresh"


def test_the_step_path_gives_the_same_answers_as_the_general_one(echo2) -> None:
    # collective_rpc(name, unique_reply_rank=r) without a future is the engine's step and has its own
    # lean path; each group below crosses both paths and must agree.
    from rayfree.worker.messages import Boxed, RemoteError

    for value in ("x", None, 7, b"raw", {"a": (1, 2)}, RemoteError(3, "E", "m", "tb"), Boxed(Boxed(1))):
        assert echo2.collective_rpc("echo", args=(value,), unique_reply_rank=1) == value  # a value, not a failure
        assert echo2.collective_rpc("echo", args=(value,), unique_reply_rank=1, non_block=True).result(30) == value
        assert echo2.collective_rpc("echo", args=(value,)) == [value, value]
    with pytest.raises(WorkerError) as info:
        echo2.collective_rpc("fail", args=("step",), unique_reply_rank=1)
    assert info.value.rank == 1 and info.value.message == "step"
    with pytest.raises(WorkerError, match="could not be sent"):
        echo2.collective_rpc("unpicklable", unique_reply_rank=0)
    for bad in (2, -1, "0", 1.0):
        with pytest.raises(ValueError, match="is not a rank"):
            echo2.collective_rpc("echo", args=(1,), unique_reply_rank=bad)
    assert echo2.collective_rpc("echo", args=("ok",), unique_reply_rank=0) == "ok"


class _Interrupt(BaseException):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step_path", [True, False], ids=["step-path", "general-path"])
def test_an_interrupted_call_fails_the_executor_instead_of_shifting_replies(step_path) -> None:
    # An interrupt can land between a reply's read and its hand-over; afterwards no reply can be trusted
    # to answer its call, so the executor must refuse further calls rather than hand out wrong answers.
    ex = MultiprocExecutor(cfg(), ECHO)
    fired: list[int] = []
    ex.register_failure_callback(lambda: fired.append(1))

    def raise_interrupt(signum, frame):
        raise _Interrupt()

    old = signal.signal(signal.SIGUSR2, raise_interrupt)
    try:
        with pytest.raises(_Interrupt):  # rank 0 signals us once it runs the call
            call = ("poke_then_sleep", (os.getpid(), signal.SIGUSR2, 0.5))
            if step_path:
                ex.collective_rpc(call[0], args=call[1], unique_reply_rank=0)
            else:
                ex.collective_rpc(call[0], args=call[1], unique_reply_rank=0, non_block=True).result(timeout=30)
        signal.signal(signal.SIGUSR2, old)
        assert ex.is_failed and fired == [1]
        with pytest.raises(ExecutorFailed, match=r"poke_then_sleep was interrupted \(_Interrupt\)"):
            ex.collective_rpc("echo", args=("next",), unique_reply_rank=0)
        with pytest.raises(ExecutorFailed, match="interrupted"):
            ex.collective_rpc("echo", args=("next",))
    finally:
        signal.signal(signal.SIGUSR2, old)
        pids = [w.proc.pid for w in ex.workers]
        ex.shutdown()
    assert wait_dead(pids, 10)


@pytest.mark.timeout(60)
def test_a_reply_the_caller_cannot_read_is_that_ranks_error_and_later_replies_stay_in_step(echo2) -> None:
    with pytest.raises(WorkerError, match=r"rank 1 .*could not be read here.*only_in_this_worker"):
        echo2.collective_rpc("unimportable_result", unique_reply_rank=1)
    with pytest.raises(WorkerError, match=r"rank 0 .*could not be read here"):
        echo2.collective_rpc("unimportable_result")  # both ranks' replies are read before it is raised
    assert echo2.collective_rpc("echo", args=("in step",)) == ["in step", "in step"]
    assert echo2.collective_rpc("echo", args=("in step",), unique_reply_rank=1) == "in step"


# -- failures -------------------------------------------------------------------------


def test_worker_exception_names_the_rank_and_shows_its_traceback(echo2) -> None:
    with pytest.raises(WorkerError) as info:
        echo2.collective_rpc("fail", args=("boom",), kwargs={"only_rank": 1})
    e = info.value
    assert e.rank == 1 and e.error_type == "ValueError" and e.message == "boom"
    assert "in fail" in e.remote_traceback and "worker rank 1 raised ValueError" in str(e)
    assert echo2.collective_rpc("echo", args=(5,)) == [5, 5]  # every reply of the failed call was consumed


def test_unknown_method_and_unpicklable_result_are_errors_not_hangs(echo2) -> None:
    with pytest.raises(WorkerError, match="AttributeError"):
        echo2.collective_rpc("no_such_method", timeout=30)
    with pytest.raises(WorkerError, match="could not be sent"):
        echo2.collective_rpc("unpicklable", unique_reply_rank=0, timeout=30)
    assert echo2.collective_rpc("echo", args=(6,), timeout=30) == [6, 6]


@pytest.mark.timeout(60)
def test_sigkilled_worker_fails_pending_and_later_calls_fast_and_calls_back_once() -> None:
    ex = MultiprocExecutor(cfg(), ECHO)
    calls: list[str] = []
    try:
        ex.register_failure_callback(lambda: calls.append("first"))
        pids = [w["pid"] for w in ex.collective_rpc("whoami")]
        pending = ex.collective_rpc("sleep", args=(60,), non_block=True)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ExecutorFailed, match=r"worker rank 1 .* died \(signal SIGKILL\)"):
            pending.result(timeout=30)
        assert time.monotonic() - t0 < 1.0, "the pending call was not failed within 1 s"
        with pytest.raises(ExecutorFailed, match="rank 1"):
            ex.collective_rpc("echo", args=(1,))
        ex.shutdown()  # returns once the monitor's own shutdown is done; the callback follows it
        wait_until(lambda: calls == ["first"], 10, "the first call")
        assert ex.is_failed
        ex.register_failure_callback(lambda: calls.append("late"))  # registered after: called at once
        assert calls == ["first", "late"]
    finally:
        ex.shutdown()
    assert wait_dead(pids, 10), "worker processes left behind"


@pytest.mark.timeout(60)
def test_a_worker_dying_in_the_engines_step_fails_it_with_the_death_as_cause() -> None:
    from rayfree.executor import WorkerDied

    ex = MultiprocExecutor(cfg(), ECHO)
    try:
        pids = [w["pid"] for w in ex.collective_rpc("whoami")]
        with pytest.raises(ExecutorFailed, match=r"RPC die failed: worker rank 1 .* died \(signal SIGKILL\)") as info:
            ex.collective_rpc("die", args=(1,), unique_reply_rank=1)  # the lean path, waiting on rank 1
        assert isinstance(info.value.__cause__, WorkerDied) and info.value.__cause__.rank == 1
        with pytest.raises(ExecutorFailed, match="rank 1"):
            ex.collective_rpc("echo", args=(1,), unique_reply_rank=0)
    finally:
        ex.shutdown()
    assert wait_dead(pids, 10), "worker processes left behind"


@pytest.mark.timeout(60)
def test_shutdown_reaches_sigkill_for_a_worker_that_ignores_sigterm() -> None:
    ex = MultiprocExecutor(cfg(tp=1, shutdown_grace_s=0.5, shutdown_term_s=0.5), ECHO)
    worker = ex.workers[0]
    pending = ex.collective_rpc("hang_ignoring_sigterm", non_block=True)
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=0.3)  # it is stuck in there, ignoring SIGTERM
    t0 = time.monotonic()
    ex.shutdown()
    took = time.monotonic() - t0
    assert worker.proc.exitcode == -signal.SIGKILL, f"exit {worker.proc.exitcode}"
    assert 1.0 <= took < 5.0
    with pytest.raises(ExecutorFailed):
        pending.result(timeout=5)
    ex.shutdown()  # idempotent


@pytest.mark.timeout(120)
def test_startup_failure_in_load_model_names_the_rank_and_leaves_nothing() -> None:
    with pytest.raises(
        WorkerStartupError,
        match=r"worker rank 1 \(pid \d+, rayfree::Worker_TP1\) failed to start \(exit code 1\): RuntimeError",
    ) as info:
        MultiprocExecutor(cfg(), ECHO, {"fail_load_on": [1]})
    assert "cannot load the model on rank 1" in str(info.value)
    assert "load_model" in info.value.remote_traceback
    with pytest.raises(
        WorkerStartupError,
        match=r"worker rank 0 \(pid \d+, rayfree::Worker_TP0\) died before becoming ready \(exit code 7\)",
    ):
        MultiprocExecutor(cfg(), ECHO, {"die_load_on": [0]})


@pytest.mark.timeout(120)
def test_workers_that_are_not_ready_in_time_are_named() -> None:
    t0 = time.monotonic()
    with pytest.raises(StartupTimeout, match=r"worker rank\(s\) \[0, 1\] did not become ready within 2s") as info:
        MultiprocExecutor(cfg(ready_timeout_s=2), ECHO, {"load_delay": 30})
    assert time.monotonic() - t0 < 15
    assert info.value.ranks == [0, 1] and isinstance(info.value, TimeoutError)


def test_bad_worker_class_paths_are_clear() -> None:
    with pytest.raises(WorkerStartupError, match="has no 'Nope'"):
        MultiprocExecutor(cfg(tp=1), "tests.support.sample_workers:Nope")
    with pytest.raises(WorkerStartupError, match="package.module:Name"):
        MultiprocExecutor(cfg(tp=1), "tests.support.sample_workers.EchoWorker")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_every_worker_exits_when_the_parent_is_sigkilled(method, monkeypatch) -> None:
    # Under fork, each worker must close the inherited parent ends of the other workers'
    # death pipes, or none of them would see EOF when the parent dies.
    monkeypatch.setenv("RAYFREE_WORKER_MULTIPROC_METHOD", method)
    script = (
        "import sys, time\n"
        "from rayfree.cluster.config import ClusterConfig, ParallelConfig\n"
        "from rayfree.executor import MultiprocExecutor\n"
        "if __name__ == '__main__':\n"
        "    ex = MultiprocExecutor(ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2)),\n"
        "                           'tests.support.sample_workers:EchoWorker')\n"
        "    print(' '.join(str(w['pid']) for w in ex.collective_rpc('whoami')), flush=True)\n"
        "    time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(x) for x in pids)
        p.kill()
        p.wait(10)
        assert wait_dead(pids, 10), "workers outlived their parent by more than 10 s"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in pids:  # a failed run must not leave orphans behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_spawn_and_fork_start_methods(method, monkeypatch) -> None:
    monkeypatch.setenv("RAYFREE_WORKER_MULTIPROC_METHOD", method)
    with MultiprocExecutor(cfg(), ECHO) as ex:
        assert ex.collective_rpc("echo", args=(method,)) == [method, method]
        assert len({w["pid"] for w in ex.collective_rpc("whoami")}) == 2


# -- the toy engine: distributed results equal the single-process model -----------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_toy_engine_matches_the_single_process_model(tp, pp) -> None:
    with MultiprocExecutor(cfg(tp=tp, pp=pp), "rayfree.cli.toy_engine:ToyWorker") as ex:
        assert ex.output_rank == (pp - 1) * tp and ex.max_concurrent_batches == pp
        for step in range(5):
            batch = make_batch(step)
            out = ex.execute_model(batch)
            assert torch.equal(out, reference_forward(batch["x"])), f"step {step} differs"
        assert ex.sample_tokens(None) == reference_forward(make_batch(4)["x"]).argmax(-1).tolist()
        ex.execute_dummy_batch()
        ex.check_health()
        titles = [open(f"/proc/{w.proc.pid}/cmdline").read() for w in ex.workers]
        want = [("Worker" + (f"_PP{r // tp}" if pp > 1 else "") + f"_TP{r % tp}") for r in range(tp * pp)]
        assert all(f"rayfree::{w}" in t for w, t in zip(want, titles)), titles


@pytest.mark.timeout(120)
def test_async_scheduling_sends_outputs_from_a_thread_in_order() -> None:
    with MultiprocExecutor(cfg(async_scheduling=True), ECHO) as ex:
        assert ex.max_concurrent_batches == 2
        futs = [ex.collective_rpc("echo", args=(i,), unique_reply_rank=1, non_block=True) for i in range(50)]
        assert [f.result(timeout=30) for f in futs] == list(range(50))
        with pytest.raises(WorkerError, match="boom"):
            ex.collective_rpc("fail", args=("boom",), timeout=30)
        assert ex.collective_rpc("echo", args=("after",), timeout=30) == ["after", "after"]


def test_uniproc_executor_runs_the_worker_in_process() -> None:
    with UniProcExecutor(cfg(tp=1), "rayfree.cli.toy_engine:ToyWorker") as ex:
        batch = make_batch(3)
        assert torch.equal(ex.execute_model(batch), reference_forward(batch["x"]))
        assert ex.collective_rpc(lambda w: w.rank) == [0]
        with pytest.raises(WorkerError, match="AttributeError"):
            ex.collective_rpc("nope")
    with pytest.raises(ValueError, match="MultiprocExecutor"):
        UniProcExecutor(cfg(tp=2), "rayfree.cli.toy_engine:ToyWorker")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["shm", "tcp"])
@pytest.mark.parametrize("shared", [False, True])
def test_a_big_argument_is_each_workers_own_copy_unless_arguments_are_shared(path: str, shared: bool) -> None:
    """`shared_arguments`: a local worker gets a 32 MiB tensor as a view of its node's ring (no copy of its
    own); the view dies with the call, so the ring serves the calls after it. Remote workers always copy."""
    t = torch.arange(8 << 20, dtype=torch.float32)
    want = float(t.double().sum())
    ex = MultiprocExecutor(cfg(path, shared_arguments=shared), ECHO, {})
    try:
        for _ in range(8):  # 256 MiB through a 96 MiB ring: chunks a live view held would stop the writer
            got = ex.collective_rpc("where", args=(t,), timeout=120)
            assert [g["sum"] for g in got] == [want, want]
            assert [g["shared"] for g in got] == [shared and path == "shm"] * 2, got
    finally:
        ex.shutdown()
