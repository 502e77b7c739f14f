"""What an engine author relies on: errors caught by the names the docs give, bad input refused before anything
starts, nothing held after a failed executor's shutdown, and vLLM's accessors. Real worker processes, over
both reply paths (shm, and TCP with force_remote)."""

from __future__ import annotations

import gc
import inspect
import multiprocessing
import os
import subprocess
import sys
import time
import weakref

import pytest

import rayfree
from rayfree import (
    ClusterConfig,
    ConfigError,
    ExecutorFailed,
    FatalWorkerError,
    MultiprocExecutor,
    ParallelConfig,
    UniProcExecutor,
    WorkerDied,
    WorkerError,
    WorkerStartupError,
)
from tests.support.config import cfg
from tests.support.paths import PYTHONPATH, pythonpath

ECHO = "tests.support.sample_workers:EchoWorker"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["shm", "tcp"])
def path(request) -> str:
    return request.param


# -- errors by name ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_dead_worker_is_caught_as_worker_died_and_as_executor_failed(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        pending = ex.collective_rpc("sleep", args=(60.0,), non_block=True)
        ex.workers[1].proc.kill()
        with pytest.raises(WorkerDied) as info:
            pending.result(timeout=30)
        assert isinstance(info.value, ExecutorFailed) and info.value.rank == 1
        assert "worker rank 1" in str(info.value)
        with pytest.raises(WorkerDied):  # every later call too
            ex.collective_rpc("echo", args=(1,), timeout=10)
        try:
            ex.collective_rpc("echo", args=(1,), timeout=10)
        except ExecutorFailed as e:  # code written for the general name keeps working
            assert isinstance(e, WorkerDied)
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reply_rank", [0, 1], ids=["the-raising-rank-replies", "a-peer-replies"])
def test_a_collective_step_that_raises_is_a_worker_error_and_an_executor_failure(path: str, reply_rank: int) -> None:
    config = cfg(path, collective_methods=["step_fail_then_allreduce"])
    ex = MultiprocExecutor(config, ECHO, {"distributed": True})
    try:
        with pytest.raises(WorkerError) as info:
            ex.collective_rpc("step_fail_then_allreduce", args=(0, 60.0), unique_reply_rank=reply_rank, timeout=60)
        assert isinstance(info.value, ExecutorFailed) and isinstance(info.value, FatalWorkerError), type(info.value)
        assert info.value.rank == 0 and "broke before the all-reduce" in str(info.value)
        with pytest.raises(ExecutorFailed) as later:
            ex.collective_rpc("echo", args=(1,), timeout=10)
        assert isinstance(later.value, WorkerError) and later.value.rank == 0
    finally:
        ex.shutdown()


@pytest.mark.timeout(120)
def test_an_exception_in_an_ordinary_rpc_is_a_worker_error_only(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        with pytest.raises(WorkerError) as info:
            ex.collective_rpc("fail", args=("on purpose",), timeout=30)
        assert not isinstance(info.value, ExecutorFailed)
        assert ex.collective_rpc("echo", args=(2,), timeout=30) == [2, 2]
    finally:
        ex.shutdown()


# -- bad input, refused before anything runs -------------------------------------------------------------

BAD = [
    ({"tensor_parallel_size": "2"}, "tensor_parallel_size='2'"),
    ({"tensor_parallel_size": 2.5}, "tensor_parallel_size=2.5"),
    ({"tensor_parallel_size": None}, "tensor_parallel_size=None"),
    ({"pipeline_parallel_size": True}, "pipeline_parallel_size=True"),
    ({"nnodes": "1"}, "nnodes='1'"),
]
BAD_CLUSTER = [
    ({"rpc_timeout_s": "5"}, "rpc_timeout_s='5'"),
    ({"join_timeout_s": None}, "join_timeout_s=None"),
    ({"collective_methods": "execute_model"}, "collective_methods='execute_model'"),
    ({"parallel": {"tensor_parallel_size": 2}}, "must be a rayfree.ParallelConfig"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", [MultiprocExecutor, UniProcExecutor])
@pytest.mark.parametrize("fields,named", BAD + BAD_CLUSTER, ids=[n for _, n in BAD + BAD_CLUSTER])
def test_bad_configuration_is_a_config_error_naming_field_and_value(executor, fields, named) -> None:
    par = {k: v for k, v in fields.items() if k in ParallelConfig.__struct_fields__}
    top = {k: v for k, v in fields.items() if k not in par}
    config = ClusterConfig(parallel=ParallelConfig(**par), **top) if "parallel" not in top else ClusterConfig(**top)
    with pytest.raises(ConfigError) as info:
        executor(config, ECHO)
    assert named in str(info.value)
    assert not multiprocessing.active_children()  # nothing was started


@pytest.mark.timeout(60)
def test_a_dict_instead_of_a_cluster_config_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="config must be a rayfree.ClusterConfig, got dict"):
        MultiprocExecutor({"parallel": {"tensor_parallel_size": 2}}, ECHO)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_wrong_worker_class_path_is_refused_before_any_worker_starts() -> None:
    t0 = time.monotonic()
    with pytest.raises(
        WorkerStartupError, match="'tests.support.sample_workers' has no 'Nope'.*before starting any worker"
    ):
        MultiprocExecutor(cfg(), "tests.support.sample_workers:Nope")
    assert time.monotonic() - t0 < 5 and not multiprocessing.active_children()


@pytest.mark.timeout(120)
def test_a_class_only_the_workers_could_import_shows_the_first_workers_error_once(tmp_path) -> None:
    """The module imports only in a worker process (it needs what only the workers have): the engine cannot
    check the path, the workers find no such class; one error with one traceback, not one per worker."""
    (tmp_path / "only_on_workers.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is None:\n"
        "    raise ImportError('only the workers can import this module')\n"
        "globals().update(Present=object)  # names made as it runs: its source cannot tell what it has\n"
    )
    script = (
        "from rayfree import ClusterConfig, ParallelConfig, MultiprocExecutor, WorkerStartupError\n"
        "cfg = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), ready_timeout_s=60)\n"
        "try:\n"
        "    MultiprocExecutor(cfg, 'only_on_workers:Missing')\n"
        "except WorkerStartupError as e:\n"
        "    print('RAISED', str(e).splitlines()[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT, str(tmp_path))}
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert "RAISED worker rank" in r.stdout and "has no 'Missing'" in r.stdout, r.stdout + r.stderr
    assert r.stderr.count("Traceback") == 0, r.stderr  # the workers did not each log theirs


@pytest.mark.timeout(120)
def test_a_worker_that_reports_a_start_up_failure_is_named_with_its_exit_code_and_traceback(path: str) -> None:
    with pytest.raises(WorkerStartupError) as info:
        MultiprocExecutor(cfg(path), ECHO, {"fail_load_on": [1]})
    text = str(info.value)
    assert "worker rank 1" in text and "failed to start (exit code 1)" in text, text
    assert "load_model" in info.value.remote_traceback


# -- nothing held --------------------------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _holders(obj: object) -> list[str]:
    """What still refers to `obj`: each referrer's type and, for a dict, a cell or a method, whose it is."""
    out = []
    for r in gc.get_referrers(obj):
        what = type(r).__name__
        if isinstance(r, dict):
            owners = [type(o).__name__ for o in gc.get_referrers(r)][:3]
            what += f" (keys {[k for k, v in r.items() if v is obj][:3]}, of {owners})"
        elif type(r).__name__ == "cell":
            what += f" (in {[getattr(f, '__qualname__', type(f).__name__) for f in gc.get_referrers(r)][:3]})"
        elif inspect.ismethod(r):
            what += f" ({r.__func__.__qualname__})"
        out.append(what)
    return out


def _one_failed_executor(path: str) -> weakref.ref:
    ex = MultiprocExecutor(cfg(path, shutdown_grace_s=1, shutdown_term_s=1), ECHO)
    ex.workers[1].proc.kill()
    assert ex.wait_done(30), "the executor did not shut down after its worker died"
    ex.shutdown()
    assert all(not hasattr(w.proc, "sentinel") for w in ex.workers)  # the Process objects were closed
    return weakref.ref(ex)


@pytest.mark.timeout(300)
def test_many_failed_executors_leave_the_descriptor_count_where_it_was_and_nothing_alive(path: str) -> None:
    _one_failed_executor(path)  # the first one opens what a process keeps (ZeroMQ's context, ...)
    gc.collect()
    before = _fds()
    gc.disable()  # the executor must go with its last reference, not at some later collection
    try:
        for _ in range(20):
            ref = _one_failed_executor(path)
            # (no collection runs: only what holds it now can still free it; a thread of the process that
            # finishes its last step a moment after shutdown returned, on a loaded machine, may be that)
            until = time.monotonic() + 5
            while ref() is not None and time.monotonic() < until:
                time.sleep(0.01)
            assert ref() is None, _holders(ref())
    finally:
        gc.enable()
    after = _fds()
    deadline = time.monotonic() + 15  # ZeroMQ's reaper thread closes a closed socket's descriptor after close()
    while after > before and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _fds()
    print(f"\n{path}: descriptors {before} before, {after} after 20 create/kill/shutdown cycles")
    assert after <= before, f"descriptors: {before} before, {after} after 20 cycles"


# -- vLLM's accessors ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_get_response_mqs_gives_one_ranks_queue_or_all(path: str) -> None:
    ex = MultiprocExecutor(cfg(path), ECHO)
    try:
        every = ex.get_response_mqs()
        assert len(every) == 2 and ex.get_response_mqs(-1) == every
        assert ex.get_response_mqs(unique_reply_rank=1) == [every[1]]
        with pytest.raises(ValueError, match="unique_reply_rank=2"):
            ex.get_response_mqs(2)
    finally:
        ex.shutdown()


# -- the API you can find ----------------------------------------------------------------------------


def _documented(func, doc: str) -> list[str]:
    params = [
        p
        for p in inspect.signature(func).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    missing += [f"{p.name} (not in the docstring)" for p in params if p.name not in doc]
    return missing


@pytest.mark.parametrize("name", ["MultiprocExecutor", "UniProcExecutor", "NodeReplicas", "MessageQueue"])
def test_public_constructors_are_typed_and_say_what_each_argument_is(name: str) -> None:
    cls = getattr(rayfree, name)
    doc = (inspect.getdoc(cls.__init__) or "") + (inspect.getdoc(cls) or "")
    assert "see the module docstring" not in doc.lower()
    assert not _documented(cls.__init__, doc), f"{name}.__init__: {_documented(cls.__init__, doc)}"


@pytest.mark.timeout(120)
def test_the_secret_can_be_given_from_python(tmp_path) -> None:
    """No RAYFREE_SECRET_FILE in the environment: the bytes, or the file's path, given to the executor."""
    from rayfree.transport.secure.policy import write_secret

    key = tmp_path / "k"
    write_secret(str(key))
    script = (
        "import os, sys\n"
        "from rayfree import ClusterConfig, ParallelConfig, MultiprocExecutor\n"
        "cfg = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), force_remote=True)\n"
        "for secret in (os.urandom(32), sys.argv[1]):\n"
        "    ex = MultiprocExecutor(cfg, 'tests.support.sample_workers:EchoWorker', secret=secret)\n"
        "    print('OK', ex.collective_rpc('echo', args=(7,), timeout=30))\n"
        "    ex.shutdown()\n"
        "try:\n"
        "    MultiprocExecutor(cfg, 'tests.support.sample_workers:EchoWorker', secret=b'short')\n"
        "except Exception as e:\n"
        "    print('REFUSED', type(e).__name__, e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAYFREE_SECRET_FILE"}
    env["PYTHONPATH"] = PYTHONPATH
    r = subprocess.run(
        [sys.executable, "-c", script, str(key)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=100
    )
    assert r.stdout.count("OK [7, 7]") == 2, r.stdout + r.stderr
    assert "REFUSED SecretError" in r.stdout and "at least 32" in r.stdout, r.stdout
