"""Leak guards shared by every test: no new orphan shm segment or ipc directory, no open ZMQ
socket, no child process left behind. And a cluster secret for the whole session (inherited by every
process the tests start), so every TCP socket in the suite runs with CURVE, as in production."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
import threading
import time

import pytest

from rayfree.procs import descendants
from rayfree.transport.secure.policy import SECRET_FILE_ENV, write_secret
from rayfree.transport.shm.segment import SEGMENT_PREFIX, creator_alive, creator_pid, entries


def _session_secret() -> None:
    if os.environ.get(SECRET_FILE_ENV):
        return
    d = tempfile.mkdtemp(prefix="rf-test-secret-")
    path = os.path.join(d, "secret")
    write_secret(path)
    os.environ[SECRET_FILE_ENV] = path
    atexit.register(shutil.rmtree, d, True)


_session_secret()


def orphan_segments() -> set[str]:
    """Segments and ipc directories whose creator is dead, or that this process made and still has."""
    me = f"{SEGMENT_PREFIX}{os.getpid()}-"
    return {n for n in entries() if os.path.basename(n).startswith(me) or not creator_alive(n)}


class _Family:
    """The processes this test started (sampled every 0.25 s while it runs): a leak is one of theirs, not one of
    another suite's running beside this one on the same machine (they share /dev/shm and /tmp)."""

    def __init__(self) -> None:
        self.pids = {os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="LeakGuardFamily")
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.pids.update(descendants(os.getpid()))
            if self._stop.wait(0.25):
                return

    def stop(self) -> set[int]:
        self._stop.set()
        self._thread.join(5)
        self.pids.update(descendants(os.getpid()))
        return self.pids


def _ours(names: set[str], pids: set[int]) -> set[str]:
    return {n for n in names if creator_pid(n) in pids}


@pytest.fixture(autouse=True)
def leak_guard():
    before = orphan_segments()
    family = _Family()
    yield
    for p in multiprocessing.active_children():
        p.join(10)
    alive = [p for p in multiprocessing.active_children()]
    for p in alive:
        p.kill()
        p.join(5)
    pids = family.stop()
    leaked = _ours(orphan_segments() - before, pids)
    # Tests in other xdist workers share /dev/shm: one of them may have just killed a process whose names its
    # own clean-up (a lifeline, an executor) is about to remove. What is still there after a while is a leak.
    deadline = time.monotonic() + 10.0
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked &= orphan_segments()
    leaked = _ours(leaked, pids | set(descendants(os.getpid())))
    for n in leaked:  # do not let one test's leak fail the next one too
        shutil.rmtree(n, ignore_errors=True) if os.path.isdir(n) else os.unlink(n)
    from rayfree.transport.secure import zap
    from rayfree.transport.zmq import lingering, sockets

    lingering.flush()  # what the process would do at exit: closed writers' publishers wait for their readers
    ctx = sockets._ctx
    open_socks = []
    if ctx is not None and sockets._ctx_pid == os.getpid():
        keep = zap.zap_socket()  # the process's ZAP handler lives as long as the process
        open_socks = [s for s in list(getattr(ctx, "_sockets", ())) if not s.closed and s is not keep]
        for s in open_socks:
            s.close(linger=0)
    assert not alive, f"child processes still running after the test: {alive}"
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"
    assert not open_socks, f"{len(open_socks)} ZMQ socket(s) left open"


_CUDA_GPUS: list[int] = []


def cuda_gpus() -> int:
    """How many GPUs CUDA sees here, asked once, in a child (this process must not initialise CUDA: the workers
    it starts would inherit a broken context); 0 where the driver lists none (RAYFREE_TOPOLOGY_ROOT's tree)."""
    if not _CUDA_GPUS:
        import subprocess
        import sys

        from rayfree import settings
        from rayfree.cluster.devices import Topology

        n = 0
        if Topology.read(settings.get("RAYFREE_TOPOLOGY_ROOT")).gpus:
            code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            n = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
        _CUDA_GPUS.append(n)
    return _CUDA_GPUS[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.gpus(n)`: the test runs where CUDA sees n GPUs, and is skipped, saying so, elsewhere."""
    marker = item.get_closest_marker("gpus")
    if marker is not None:
        want, have = int(marker.args[0]), cuda_gpus()
        if have < want:
            pytest.skip(f"needs {want} NVIDIA GPU(s) that CUDA sees; this machine has {have}")
