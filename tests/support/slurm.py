"""A real Slurm cluster on this machine, for tests: slurmctld and one slurmd per simulated node, with munge.

Each Slurm node is a SimulatedNode (network namespace, own address, own /dev/shm)
with its own host name (a UTS namespace) and the cluster's names in its
/etc/hosts; slurmctld runs in one more, named as SlurmctldHost says (it starts
under no other name). munged runs with a socket and key of its own, so
nothing of a system munge is touched. What it took (Slurm 22.05 from Debian):
`ip netns exec` mounts a fresh /sys, so cgroups are off (proctrack/linuxproc,
task/none, jobacct_gather/none, cgroup.conf's cgroup/v1 with nothing
constrained); several slurmd on one host need `%n` in their spool, pid and log
paths and `SlurmdParameters=config_overrides`; jobs are cancelled before the
daemons stop, or `srun` clients hang. Everything is removed on exit, also when
the body raises.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from rayfree.cluster.simulate import SimulatedCluster

__all__ = ["SlurmCluster", "have_slurm", "install_slurm"]

PACKAGES = ["slurm-wlm", "munge"]
DAEMONS = ["slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol"]


def have_slurm() -> bool:
    return all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS)


def install_slurm() -> None:
    """Debian's slurm-wlm and munge, where missing (as compose-check installs docker)."""
    if have_slurm():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env, capture_output=True, timeout=600)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


class SlurmCluster:
    """`nnodes` Slurm compute nodes (slurmd each) + a controller, as a context manager.

    `run(argv)` runs a Slurm client (sbatch, srun, scontrol, ...) beside the controller; `env` is what it
    needs (SLURM_CONF, PATH to this interpreter's scripts).
    """

    def __init__(self, nnodes: int, cpus: int = 2) -> None:
        self.nnodes = nnodes
        self.cpus = cpus
        self.names = [f"rfs{k}" for k in range(nnodes)]
        self.sim = SimulatedCluster(nnodes + 1, hostnames=[*self.names, "rfctl"])
        self.dir = ""
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}
        self.t_up = 0.0

    # -- set-up -----------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        t0 = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="rayfree-slurm-")
        os.chmod(self.dir, 0o755)
        try:
            self.sim.__enter__()
            self._munge()
            self._config()
            ctl = self.sim.nodes[-1]
            self.procs.append(ctl.popen(["slurmctld", "-D", "-i"], env=self.env, **self._quiet("slurmctld")))
            for k, name in enumerate(self.names):
                node = self.sim.nodes[k]
                self.procs.append(
                    node.popen(["slurmd", "-D", "-N", name], env=self.env, **self._quiet(f"slurmd-{name}"))
                )
            self._wait_idle(60)
            self.t_up = time.monotonic() - t0
        except BaseException:
            self.close()
            raise
        return self

    def _quiet(self, name: str) -> dict[str, Any]:
        out = open(os.path.join(self.dir, f"{name}.stdout"), "w")  # noqa: SIM115 - closed with the process
        return {"stdout": out, "stderr": subprocess.STDOUT}

    def _munge(self) -> None:
        d = os.path.join(self.dir, "munge")
        os.makedirs(d, mode=0o755)
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o600)
        shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        self.munge_socket = os.path.join(d, "munge.socket")
        p = subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            start_new_session=True, **self._quiet("munged"),
        )  # fmt: skip
        self.procs.append(p)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"munged did not start:\n{self._log('munged.stdout')}{self._log('munge/munged.log')}"
                )
            time.sleep(0.05)

    def _config(self) -> None:
        d = self.dir
        ctl = self.sim.nodes[-1]
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.sim.nodes[k].ip} CPUs={self.cpus} State=UNKNOWN"
            for k, name in enumerate(self.names)
        )
        os.makedirs(os.path.join(d, "state"))
        _write(
            os.path.join(d, "slurm.conf"),
            f"""ClusterName=rayfreesim
SlurmctldHost=rfctl({ctl.ip})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
KillWait=5
MessageTimeout=10
{nodes}
PartitionName=rf Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""",
        )
        _write(os.path.join(d, "cgroup.conf"), "CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n")
        self.env = {"SLURM_CONF": os.path.join(d, "slurm.conf")}

    def _log(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f"--- {name} ---\n{f.read()[-3000:]}\n"
        except OSError:
            return ""

    def logs(self) -> str:
        return "".join(self._log(n) for n in ["slurmctld.log", *[f"slurmd-{n}.log" for n in self.names]])

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = self.run(["sinfo", "-h", "-o", "%T %D"], timeout=15)
            states = r.stdout.split()
            if r.returncode == 0 and states[:1] == ["idle"] and states[1:2] == [str(self.nnodes)]:
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args}):\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {r.stdout} {r.stderr}\n{self.logs()}")
            time.sleep(0.2)

    # -- use ------------------------------------------------------------------------------

    def client_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        import sys

        bindir = os.path.dirname(sys.executable)
        return {**os.environ, **self.env, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", **(extra or {})}

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None, **kw: Any):
        """A Slurm client command beside the controller (its network namespace)."""
        ctl = self.sim.nodes[-1]
        return subprocess.run(
            ctl.command(argv), env=env or self.client_env(), capture_output=True, text=True, timeout=timeout, **kw
        )

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """As `run`, not waited for (in a session of its own)."""
        p = subprocess.Popen(
            self.sim.nodes[-1].command(argv), env=env or self.client_env(), start_new_session=True, **kw
        )
        self.sim.nodes[-1].procs.append(p)
        return p

    # -- tear-down ------------------------------------------------------------------------

    def close(self) -> None:
        if self.env:
            self.run(["scancel", "--full", "--partition=rf"], timeout=30)  # before the daemons, or srun hangs
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                r = self.run(["squeue", "-h"], timeout=15)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.2)
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.sim.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()
