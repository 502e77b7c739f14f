"""Faults and misuse, tried as an engine would meet them: none may hang, mislead or leave anything behind.

Each test runs over both paths where both apply: `shm` (the workers read the broadcast from shared
memory) and `tcp` (force_remote: every queue is a CURVE-secured TCP socket on loopback).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.executor import ExecutorFailed, MultiprocExecutor, RpcTimeout, WorkerDied, WorkerError
from rayfree.procs import descendants, is_alive, stat_fields
from rayfree.transport.shm.segment import creator_alive, creator_pid, entries
from tests.support import children as procs
from tests.support.config import cfg
from tests.support.waits import wait_until

ECHO = "tests.support.sample_workers:EchoWorker"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["shm", "tcp"])
def path(request) -> str:
    return request.param


def topology(ex: MultiprocExecutor) -> list[str]:
    from rayfree.worker.proc import worker_info

    return [i["broadcast"] for i in ex.collective_rpc(worker_info, timeout=30)]


# -- fail fast on any rank's error in a collective step ---------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail_rank", [1, 0])
def test_an_exception_in_a_collective_step_fails_the_executor_within_a_second(path: str, fail_rank: int) -> None:
    """TP=2 in a real gloo world: one rank raises before an all-reduce its peer blocks in. The step fails
    with that rank's traceback, the executor is failed, the callback fires once, every worker is stopped."""
    c = cfg(path, collective_methods=["step_fail_then_allreduce", "execute_model"])
    ex = MultiprocExecutor(c, ECHO, {"distributed": True})
    try:
        assert topology(ex) == [path, path]
        fired: list[float] = []
        ex.register_failure_callback(lambda: fired.append(time.monotonic()))
        pids = [w.proc.pid for w in ex.workers]
        t0 = time.monotonic()
        with pytest.raises((ExecutorFailed, WorkerError)) as info:
            ex.collective_rpc("step_fail_then_allreduce", args=(fail_rank,), unique_reply_rank=0, timeout=60)
        took = time.monotonic() - t0
        text = str(info.value) + str(info.value.__cause__ or "")
        assert f"worker rank {fail_rank} raised RuntimeError in step_fail_then_allreduce" in text, text
        assert "broke before the all-reduce" in text and "Worker traceback" in text, text
        assert took < 5.0, f"the step failed after {took:.1f}s"
        wait_until(lambda: fired, 5, "the failure callback")
        assert ex.is_failed and len(fired) == 1
        wait_until(lambda: not any(is_alive(p) for p in pids), 10, "every worker stopped")
        with pytest.raises(ExecutorFailed, match=f"worker rank {fail_rank} raised"):
            ex.collective_rpc("echo", args=(1,))
        assert len(fired) == 1
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_a_failing_execute_model_on_a_rank_that_does_not_reply_is_fatal(path: str) -> None:
    """The default collective methods include execute_model: rank 1 raises, rank 0 replies normally."""
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        t0 = time.monotonic()
        try:
            ex.execute_model({"fail_rank": 1})
        except ExecutorFailed:
            pass  # the reply rank's answer raced the failure: either way the executor must now be failed
        wait_until(lambda: ex.is_failed, 5, "the executor failed")
        assert time.monotonic() - t0 < 5
        assert "worker rank 1 raised RuntimeError in execute_model" in str(ex.failure)
        with pytest.raises(ExecutorFailed, match="execute_model broke on rank 1"):
            ex.execute_model({"x": 1})
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_an_exception_in_an_ordinary_rpc_goes_to_its_caller_only(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        with pytest.raises(WorkerError, match="worker rank 1 raised ValueError in fail: bad adapter"):
            ex.collective_rpc("fail", args=("bad adapter", 1), timeout=30)
        assert not ex.is_failed
        assert ex.collective_rpc("echo", args=(7,), timeout=30) == [7, 7]
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_the_collective_methods_are_configurable(path: str) -> None:
    ex = MultiprocExecutor(cfg(path, collective_methods=[]), ECHO)
    try:
        with pytest.raises(WorkerError, match="execute_model broke on rank 0"):
            ex.execute_model({"fail_rank": 0})
        assert not ex.is_failed and ex.execute_model({"x": 2}) == ("executed", 0, {"x": 2})
    finally:
        ex.shutdown()


# -- timeouts, threads, many calls -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_every_call_honours_its_timeout_including_the_draft_token_call(path: str) -> None:
    ex = MultiprocExecutor(cfg(path, rpc_timeout_s=1.0), ECHO, {"draft_delay": 6.0})
    try:
        for call in (
            ex.take_draft_token_ids,
            lambda: ex.collective_rpc("sleep", args=(6.0, 0), unique_reply_rank=0, timeout=1.0),
            lambda: ex.collective_rpc("sleep", args=(6.0, 1), timeout=1.0),
        ):
            t0 = time.monotonic()
            with pytest.raises(RpcTimeout):
                call()
            took = time.monotonic() - t0
            assert 0.9 <= took < 2.0, f"a 1 s timeout took {took:.2f}s"
    finally:
        ex.shutdown()


@pytest.mark.timeout(180)
def test_two_threads_calling_at_once_never_get_each_others_replies(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    wrong: list[tuple] = []
    errors: list[BaseException] = []

    def caller(tag: str) -> None:
        try:
            for i in range(300):
                v = (tag, i)
                if i % 3 == 0:
                    got = ex.collective_rpc("echo", args=(v,), timeout=30)
                    if got != [v, v]:
                        wrong.append((v, got))
                elif i % 3 == 1:
                    got = ex.collective_rpc("echo", args=(v,), unique_reply_rank=1, timeout=30)
                    if got != v:
                        wrong.append((v, got))
                else:
                    got = ex.collective_rpc("echo", args=(v,), non_block=True).result(timeout=30)
                    if got != [v, v]:
                        wrong.append((v, got))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        ts = [threading.Thread(target=caller, args=(t,)) for t in "ab"]
        for t in ts:
            t.start()
        for t in ts:
            t.join(150)
        assert not any(t.is_alive() for t in ts), "a caller hung"
        assert not errors, errors
        assert not wrong, f"{len(wrong)} wrong replies, e.g. {wrong[:3]}"
    finally:
        ex.shutdown()


@pytest.mark.timeout(180)
def test_hundreds_of_outstanding_non_block_calls_do_not_hang(path: str) -> None:
    """The replies of pending calls are read while a send waits for room: no limit, no hang."""
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        payload = bytes(300 << 10)  # one chunk's worth of replies fills a reply ring after a few calls
        t0 = time.monotonic()
        futs = [ex.collective_rpc("echo", args=((i, payload),), non_block=True, timeout=60) for i in range(300)]
        got = [f.result(timeout=60) for f in futs]
        assert [g[0][0] for g in got] == list(range(300)) and all(g[1][1] == payload for g in got)
        assert time.monotonic() - t0 < 90
    finally:
        ex.shutdown()


# -- a caller blocked sending is released ----------------------------------------------------------


def _block_a_sender(ex: MultiprocExecutor) -> tuple[threading.Thread, list]:
    """Rank 0 busy for a minute; another thread sends 40 MiB messages until the 96 MiB ring is full."""
    ex.collective_rpc("sleep", args=(60.0, 0), non_block=True)
    out: list = []

    def send() -> None:
        try:
            for _ in range(4):
                ex.collective_rpc("echo", args=(bytearray(40 << 20),), non_block=True)
            out.append("not blocked")
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            out.append(e)

    t = threading.Thread(target=send)
    t.start()
    t.join(2.0)
    assert t.is_alive() and not out, f"the sender was not blocked: {out}"
    return t, out


@pytest.mark.timeout(120)
def test_a_sender_blocked_on_a_full_ring_is_released_by_shutdown() -> None:
    ex = MultiprocExecutor(cfg("shm"), ECHO)
    try:
        t, out = _block_a_sender(ex)
        t0 = time.monotonic()
        threading.Thread(target=ex.shutdown).start()
        t.join(10)
        took = time.monotonic() - t0
        assert not t.is_alive() and isinstance(out[0], ExecutorFailed), out
        assert took < 1.5, f"released after {took:.2f}s"
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_a_sender_blocked_on_a_full_ring_is_released_by_a_worker_death() -> None:
    ex = MultiprocExecutor(cfg("shm"), ECHO)
    try:
        t, out = _block_a_sender(ex)
        t0 = time.monotonic()
        os.kill(ex.workers[0].proc.pid, signal.SIGKILL)
        t.join(10)
        took = time.monotonic() - t0
        assert not t.is_alive() and isinstance(out[0], ExecutorFailed), out
        assert "worker rank 0" in str(out[0]) and "SIGKILL" in str(out[0]), out[0]
        assert took < 1.5, f"released after {took:.2f}s"
    finally:
        ex.shutdown()


# -- workers that leave, break or ignore us -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_worker_that_exits_on_its_own_is_named_with_its_exit_code(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        with pytest.raises(ExecutorFailed) as info:
            ex.collective_rpc("exit_now", args=(3, 1), timeout=30)
        assert "worker rank 1" in str(info.value) and "exit code 3" in str(info.value), info.value
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_an_exception_whose_str_raises_is_reported_and_the_executor_lives_on(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        with pytest.raises(WorkerError, match=r"raised BadStr in bad_str_error: <str\(\) of this BadStr raised"):
            ex.collective_rpc("bad_str_error", timeout=30)
        assert not ex.is_failed and ex.collective_rpc("echo", args=(1,), timeout=30) == [1, 1]
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_sigterm_stops_a_busy_worker_without_waiting_for_sigkill(path: str) -> None:
    ex = MultiprocExecutor(cfg(path, shutdown_grace_s=1.0, shutdown_term_s=20.0), ECHO)
    workers = list(ex.workers)
    ex.collective_rpc("busy", args=(60.0,), non_block=True)
    time.sleep(0.3)  # let them be inside the call (no event to wait on: they are busy by design)
    t0 = time.monotonic()
    ex.shutdown()
    took = time.monotonic() - t0
    assert took < 5.0, f"shutdown took {took:.1f}s: SIGTERM did not stop the busy workers"
    codes = [w.proc.exitcode for w in workers]  # the handles keep each exit after the processes are released
    assert all(c is not None and c != -signal.SIGKILL for c in codes), codes


@pytest.mark.timeout(120)
def test_a_worker_that_dies_in_the_start_up_handshake_is_named_and_leaves_nothing(path: str) -> None:
    """After READY its reply ring and ipc directory exist and nobody has unlinked them yet: the executor
    names the worker (pid, title, exit code) and removes what it made."""
    before = entries()
    with pytest.raises(WorkerDied) as info:
        MultiprocExecutor(cfg(path), ECHO, {"die_in_handshake_on": [1]})
    text = str(info.value)
    assert "worker rank 1" in text and "rayfree::Worker_TP1" in text and "exit code 9" in text, text

    # (tests running beside this one have live segments of their own: only ours, or a dead maker's, count; and
    # another suite's dead worker leaves its segments to its own executor, which removes them a moment later,
    # where a leak stays: beside another suite one was seen here in that moment)
    def left() -> set[str]:
        return {e for e in entries() - before if creator_pid(e) == os.getpid() or not creator_alive(e)}

    try:
        wait_until(lambda: not left(), 20, "what a dead maker left removed", every=0.1)
    except AssertionError:
        raise AssertionError(f"left behind: {sorted(left())}") from None


# -- the engine's process dies ----------------------------------------------------------------------

ENGINE = """
import sys, time
from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.executor import MultiprocExecutor
if __name__ == "__main__":
    how, path = sys.argv[1], sys.argv[2]
    early = how in ("load", "spawning", "unpickle-fails")
    kw = {"load_delay": 60.0} if early else {}
    if how in ("spawning", "unpickle-fails"):
        from tests.support.sample_workers import SlowToUnpickle
        # the workers are still unpickling their arguments when the engine dies (and then that fails too)
        kw["slow"] = SlowToUnpickle(2.0, fail=how == "unpickle-fails")
    c = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), force_remote=path == "tcp")
    if early:
        print("STARTING", flush=True)
    ex = MultiprocExecutor(c, "tests.support.sample_workers:EchoWorker", kw)
    print("PIDS", *[w.proc.pid for w in ex.workers], flush=True)
    ex.collective_rpc("busy", args=(60.0,), non_block=True)
    time.sleep(0.5)
    print("BUSY", flush=True)
    time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        fields = stat_fields(int(name)) if name.isdigit() else None
        if fields is not None and fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(name))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["call", "load", "spawning", "unpickle-fails"])
def test_workers_leave_within_a_second_when_the_engine_is_sigkilled(path: str, how: str, tmp_path) -> None:
    """Mid-call (busy in Python), mid-load (before the queue handshake) or while still unpickling their
    arguments (2 s; and once that unpickling fails, so no worker code of the engine's ever runs): the workers
    exit within about a second of their parent's death, and no segment or ipc directory of any of them, nor of
    the engine, is left."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    err = open(tmp_path / "engine.err", "w+")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, str(script), how, path], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env
    )
    try:
        early = how in ("load", "spawning", "unpickle-fails")
        expect = "STARTING" if early else "BUSY"
        pids: list[int] = []
        while True:
            line = p.stdout.readline()  # the test's timeout bounds this
            if not line:
                err.seek(0)
                raise AssertionError(f"the engine ended before {expect}:\n{err.read()[-3000:]}")
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
            if line.startswith(expect):
                break
        if early:  # the workers are spawned: find them as the engine's children
            wait_until(lambda: len([c for c in _children(p.pid) if _is_worker(c)]) == 2, 60, "two loading workers")
            pids = [c for c in _children(p.pid) if _is_worker(c)]
            if how == "load":  # their title is set just before load_model (60 s here): they are in it
                wait_until(lambda: all(_cmdline(x).startswith(b"rayfree::") for x in pids), 60, "workers in load")
        engine_pid = p.pid
        p.kill()
        p.wait(10)
        took = wait_until(lambda: not any(is_alive(x) for x in pids), 10, f"the workers {pids} left")
        # Promptly, not at the end of the 60 s load or the call: about a second on a quiet machine (printed),
        # 4.0 s beside another suite on two cores, where each of the lifeline's threads waits for a CPU.
        # "spawning": they first finish unpickling (2 s) and importing (torch: up to several seconds there)
        assert took < 2.0 + 8.0, f"the workers took {took:.1f}s to leave"
        print(f"\n{how}: the workers left {took:.2f}s after the engine's SIGKILL")
        left = [e for e in entries() if any(f"rayfree-{x}-" in e for x in (*pids, engine_pid))]
        assert not left, f"left behind: {left}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        err.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _is_worker(pid: int) -> bool:
    return b"spawn_main" in _cmdline(pid)


# -- vLLM's names, and a join that keeps its bound ------------------------------------------------------


class _Agg:
    """A stand-in for vLLM's KVOutputAggregator: it sees every rank's output and the reply rank."""

    def __init__(self) -> None:
        self.calls: list = []

    def aggregate(self, outputs, output_rank: int = 0):
        self.calls.append((outputs, output_rank))
        return ("aggregated", len(outputs), output_rank)


@pytest.mark.timeout(120)
def test_the_names_vllms_engine_uses_are_there(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        assert ex.supports_pp is True and MultiprocExecutor.supports_async_scheduling() is True
        assert len(ex.get_response_mqs()) == 2 and not ex.shutdown_event.is_set()
        agg = _Agg()
        assert ex.collective_rpc("echo", args=(5,), unique_reply_rank=1, kv_output_aggregator=agg) == (
            "aggregated",
            2,
            1,
        )
        assert agg.calls == [([5, 5], 1)]
        ex.kv_output_aggregator = agg
        assert ex.execute_model({"x": 1}) == ("aggregated", 2, 0)
        assert ex.collective_rpc("echo", args=(6,), non_block=True, ec_output_aggregator=agg).result(30) == (
            "aggregated",
            2,
            0,
        )
    finally:
        ex.shutdown()
    assert ex.shutdown_event.is_set()


@pytest.mark.timeout(120)
def test_a_leader_alone_fails_within_its_join_timeout() -> None:
    from rayfree.transport import get_open_port

    port, hb = get_open_port("127.0.0.1"), get_open_port("127.0.0.1")
    c = ClusterConfig(
        parallel=ParallelConfig(
            tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port
        ),
        heartbeat_port=hb,
        join_timeout_s=4,
        shutdown_grace_s=2,
        shutdown_term_s=2,
    )
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"rank\(s\) \[1\] of 2 never joined .* within 4s") as info:
        MultiprocExecutor(c, ECHO, {"distributed": True})
    took = time.monotonic() - t0
    # The join's own bound, from the rank's own count (TCPStore alone retried well past it); the whole start-up
    # adds the worker's spawn (its torch import: unbounded on a loaded machine), node 0's window for telling late
    # followers (TELL_LATE_S) and the staged close.
    m = re.search(r"gave up after ([0-9.]+)s", str(info.value))
    assert m, str(info.value)
    print(
        f"\nthe join gave up after {m.group(1)} s of its 4 s bound; the executor's start-up failed after {took:.1f} s"
    )
    assert float(m.group(1)) < 4 + 1.0, str(info.value)
    # (the join's message says all, ranks and where: no worker traceback comes with it, as with a config error)
    assert "Traceback" not in str(info.value) and getattr(info.value, "remote_traceback", None) == "", str(info.value)


# -- a TCP link that drops ----------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.skipif(not procs.CAN_CUT_TCP, reason="cutting a TCP connection takes root and ss")
def test_a_reply_link_that_drops_fails_the_call_naming_the_dropped_connection(monkeypatch) -> None:
    """TCP queues (force_remote): `ss -K` cuts the executor's connection to rank 1's reply queue. The next call
    that waits for rank 1's reply fails once RAYFREE_LINK_GRACE_S (1 s here) has passed, with an ExecutorFailed
    that says the connection dropped, instead of hanging (the call has no timeout) or blaming a shutdown."""
    monkeypatch.setenv("RAYFREE_LINK_GRACE_S", "1")  # read by the executor's reply readers
    ex = MultiprocExecutor(cfg("tcp"), ECHO)
    try:
        assert ex.collective_rpc("echo", args=(1,), timeout=30) == [1, 1]
        port = ex.response_mqs[1].handle.remote_endpoint.rsplit(":", 1)[1]
        procs.cut_tcp(port)
        t0 = time.monotonic()
        with pytest.raises(ExecutorFailed, match="connection to the writer .* dropped") as err:
            ex.collective_rpc("echo", args=(2,), unique_reply_rank=1)
        took = time.monotonic() - t0
    finally:
        ex.shutdown()
    assert type(err.value.__cause__).__name__ == "QueueBroken"
    assert took < 15, took


@pytest.mark.timeout(120)
def test_a_follower_told_of_node_0s_failure_before_its_executor_started_starts_no_worker() -> None:
    """Node 0 refuses to start (its goodbye reaches a follower still importing, before its executor attached to
    the node's liveness): the executor raises LeaderLost at once and spawns nothing (it waited for its ranks'
    READY until ready_timeout_s before, as a relay did for its ranks)."""
    from rayfree.executor.errors import LeaderLost
    from rayfree.executor.liveness import for_node
    from rayfree.transport import get_open_port

    port, hb = get_open_port("127.0.0.1"), get_open_port("127.0.0.1")

    def node(rank: int) -> ClusterConfig:
        par = ParallelConfig(
            tensor_parallel_size=2, nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=port
        )
        return ClusterConfig(parallel=par, heartbeat_port=hb, join_timeout_s=30, ready_timeout_s=60)

    leader = for_node(node(0))
    refusing = threading.Thread(target=leader.refuse, args=("node 0 refused to start: a test's reason", 20))
    refusing.start()
    follower = for_node(node(1))
    try:
        assert follower.settled.wait(20), "the follower was never told of node 0's failure"
        before, seen, done = set(descendants(os.getpid())), set(), threading.Event()

        def sample() -> None:  # a spawned worker lives for seconds (its torch import): 10 ms samples see it
            while not done.wait(0.01):
                seen.update(set(descendants(os.getpid())) - before)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(LeaderLost, match="a test's reason"):
                MultiprocExecutor(node(1), ECHO, {"distributed": True}, liveness=follower)
        finally:
            done.set()
            sampler.join(5)
        took = time.monotonic() - t0
        assert not seen, f"processes started: {seen}"
        print(f"\nthe executor raised the leader's failure after {took:.2f} s")
    finally:
        refusing.join(30)
        if follower.beater is not None:
            follower.beater.close()
