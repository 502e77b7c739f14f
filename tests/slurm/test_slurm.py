"""rayfree under a real Slurm (Debian's slurm-wlm and munge, slurmd per simulated node): the shipped sbatch
script runs to the end with every output equal; a node's task killed mid-run fails the job on every node,
naming the node, leaving nothing; the batch-shell and several-tasks-per-node mistakes are refused; rayfree's
host-list expansion agrees with `scontrol show hostnames`.

`make test-slurm` installs the packages where missing and runs this file (RAYFREE_TEST_SLURM=1); elsewhere it
is skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from rayfree.cluster.simulate import can_use_netns
from rayfree.launch.hostlist import expand_hostlist
from rayfree.procs import group_members
from rayfree.transport.secure import policy as security
from tests.support.nodes import ROOT
from tests.support.paths import PYTHONPATH
from tests.support.slurm import SlurmCluster, have_slurm, install_slurm

if os.environ.get("RAYFREE_TEST_SLURM") != "1":
    pytest.skip("a real Slurm: `make test-slurm` runs these", allow_module_level=True)
if not can_use_netns():
    pytest.fail("RAYFREE_TEST_SLURM=1 needs root (network namespaces, slurmd, munge)")

SBATCH = os.path.join(ROOT, "deploy", "slurm", "rayfree.sbatch")


@pytest.fixture(scope="module")
def slurm():
    install_slurm()
    assert have_slurm()
    with SlurmCluster(2) as s:
        print(f"\nSlurm cluster of 2 nodes up in {s.t_up:.2f} s")
        yield s


@pytest.fixture
def job_env(slurm, tmp_path):
    os.chmod(tmp_path, 0o755)
    secret = str(tmp_path / "secret")
    security.write_secret(secret)
    return slurm.client_env(
        {
            "RAYFREE_SECRET_FILE": secret,
            "PYTHONPATH": PYTHONPATH,
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            "RAYFREE_LOG_LEVEL": "INFO",
        }
    )


def job_procs(job: str) -> list[int]:
    """Processes (any namespace) whose environment says they belong to Slurm job `job`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env:
            out.append(int(name))
    return out


def segments(slurm: SlurmCluster) -> list[str]:
    return [f for n in slurm.sim.nodes[:-1] for f in os.listdir(n.shm_dir) if f.startswith("rayfree-")]


@pytest.mark.timeout(300)
def test_the_shipped_sbatch_script_runs_the_toy_engine_to_the_end(slurm, job_env, tmp_path) -> None:
    out = tmp_path / "job.out"
    t0 = time.monotonic()
    r = slurm.run(
        ["sbatch", "--wait", "-o", str(out), SBATCH], timeout=240, env={**job_env, "RAYFREE_DEMO_STEPS": "50"}
    )
    took = time.monotonic() - t0
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{text[-4000:]}\n{slurm.logs()}"
    assert re.search(r"outputs equal to 1-process model\s+50$", text, re.M), text[-3000:]
    assert "node placed by slurm" in text and "SLURM_NODEID=1" in text, text[-3000:]
    job = r.stdout.split()[-1]
    assert not job_procs(job) and not segments(slurm)
    print(f"\nsbatch {os.path.relpath(SBATCH, ROOT)}: job {job} done in {took:.1f} s; its output:\n{text}")


@pytest.mark.timeout(300)
def test_a_killed_task_fails_the_job_on_every_node_naming_the_node(slurm, job_env, tmp_path) -> None:
    out = tmp_path / "job.out"
    p = slurm.popen(
        ["sbatch", "--wait", "-o", str(out), SBATCH],
        env={**job_env, "RAYFREE_DEMO_STEPS": "100000000", "RAYFREE_HEARTBEAT_TIMEOUT_S": "3"},
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not (out.exists() and "workers on 2 node(s) ready" in out.read_text()):
        assert p.poll() is None and time.monotonic() < deadline, out.read_text() if out.exists() else ""
        time.sleep(0.2)
    job = re.search(r"(\d+)", p.stdout.readline()).group(1)  # "Submitted batch job N"
    victim = [
        pid
        for pid in job_procs(job)
        if b"SLURM_NODEID=1" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        and b"rayfree node" in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    ]
    assert len(victim) == 1, victim
    leader = [
        pid
        for pid in job_procs(job)
        if b"SLURM_NODEID=0" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        and b"rayfree node" in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    ]
    t0 = time.monotonic()
    os.kill(victim[0], signal.SIGKILL)
    while any(os.path.exists(f"/proc/{pid}") for pid in leader) and time.monotonic() < t0 + 60:
        time.sleep(0.02)
    node0_out = time.monotonic() - t0
    code = p.wait(60)
    took = time.monotonic() - t0
    text = out.read_text()
    assert code != 0, text[-3000:]
    named = re.search(r"^.*node 1 \(10\.77\.0\.2.*(was lost|connection dropped).*$", text, re.M)
    assert named, text[-6000:]
    deadline = time.monotonic() + 15
    while (job_procs(job) or segments(slurm)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job_procs(job) and not segments(slurm), (job_procs(job), segments(slurm))
    print(
        f"\nnode 1's task SIGKILLed: node 0's task out {node0_out:.2f} s later, the job ended (exit {code}) after "
        f"{took:.2f} s; node 0 said: {named.group(0)}"
    )


@pytest.mark.timeout(120)
def test_the_batch_shell_and_two_tasks_per_node_are_refused(slurm, job_env, tmp_path) -> None:
    node = "rayfree node --dry-run --worker a:B --entry a:f --tp 2"
    out = tmp_path / "batch.out"
    r = slurm.run(["sbatch", "--wait", "-N2", "-o", str(out), "--wrap", node], timeout=60, env=job_env)
    assert r.returncode != 0 and "SLURM_STEP_ID is not: this is the batch script's shell of a job on 2 nodes" in (
        out.read_text()
    ), out.read_text()
    r = slurm.run(["srun", "-N2", "--ntasks-per-node=2", *node.split()], timeout=60, env=job_env)
    assert r.returncode != 0 and "SLURM_STEP_TASKS_PER_NODE=2(x2): rayfree runs one task per node" in r.stderr, (
        r.stdout + r.stderr
    )
    r = slurm.run(["srun", "-N2", "--ntasks-per-node=1", *node.split()], timeout=60, env=job_env)
    assert r.returncode == 0, r.stderr
    assert "node_rank   = 1  (slurm: SLURM_NODEID=1)" in r.stdout and "hosts rfs0, rfs1" in r.stdout, r.stdout


def test_host_lists_expand_as_scontrol_does(slurm) -> None:
    lists = ["gpu[01-04,07]", "a[1-2]-b[3-4]", "n1,n[3-4],login", "node-[9-11]", "x[008-010],y"]
    for text in lists:
        r = slurm.run(["scontrol", "show", "hostnames", text], timeout=30)
        assert r.returncode == 0, r.stderr
        assert expand_hostlist(text) == r.stdout.split(), text


def test_nothing_of_the_cluster_is_left_when_it_is_gone() -> None:
    s = SlurmCluster(2)
    with s:
        pids = [p.pid for p in s.procs]
    assert all(not group_members(pid) for pid in pids)
    assert not os.path.exists(s.dir)
