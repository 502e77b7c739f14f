"""`rayfree doctor`: each check can fail, and says how to fix it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayfree.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if f"] {name}" in ln)


@pytest.mark.timeout(90)
def test_a_sane_single_node_passes_quick_and_full() -> None:
    for args in (["--quick"], []):
        r = doctor(*args, "--master-port", str(_free_port()))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "nothing blocks a run" in r.stdout
        assert "[ ok ] /dev/shm" in r.stdout


@pytest.mark.timeout(90)
def test_each_problem_is_reported_with_its_fix() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        r = doctor("--master-port", str(port), env={"GLOO_SOCKET_IFNAME": "no-such-if0"})
    assert r.returncode == 1
    assert "FAIL" in line(r.stdout, "ports") and f"in use on 127.0.0.1: {port}" in line(r.stdout, "ports")
    assert "FAIL" in line(r.stdout, "socket ifname") and "no-such-if0" in r.stdout
    assert r.stdout.count("fix:") >= 2
    r = doctor("--quick", "--nnodes", "2", "--tp", "2", "--master-addr", "192.0.2.254")
    assert r.returncode == 1 and "FAIL" in line(r.stdout, "master_addr") and "node 0" in r.stdout
    r = doctor(
        "--quick",
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        env={"RAYFREE_HOST_IP": "127.0.0.1"},
    )
    assert r.returncode == 1 and "FAIL" in line(r.stdout, "address") and "RAYFREE_HOST_IP" in r.stdout


@pytest.mark.timeout(90)
def test_stale_segments_of_dead_processes_are_found_and_removed_on_request(tmp_path) -> None:
    # A private runtime dir: the leak guard of tests running in parallel would clean up a fake in /dev/shm.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # its pid now names a dead process
    stale = tmp_path / f"rayfree-{gone.pid}-doctortest"
    stale.mkdir(mode=0o700)
    (stale / "ep").write_bytes(b"x" * 4096)
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    r = doctor("--quick", env=env)
    assert "warn" in line(r.stdout, "stale segments") and stale.name in r.stdout
    assert "rayfree doctor --fix" in r.stdout and stale.exists()
    r = doctor("--quick", "--fix", env=env)
    assert "removed" in line(r.stdout, "stale segments")
    assert not stale.exists()


def _free_port() -> int:
    """A master port whose heartbeat port (master_port + 1) is free too, both below the kernel's ephemeral range
    (where another test's outgoing connection cannot take them meanwhile: seen in CI)."""
    from rayfree.transport import get_open_port

    for _ in range(100):
        port = get_open_port("127.0.0.1")
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row on 127.0.0.1")


@pytest.mark.timeout(90)
def test_dp_replicas_are_listed_with_this_node_s_place() -> None:
    r = doctor(
        "--quick",
        "--nnodes",
        "4",
        "--dp",
        "2",
        "--tp",
        "2",
        "--node-rank",
        "3",
        "--master-addr",
        "10.0.0.1",
        "--insecure",
    )
    assert "DP=2 replicas of 2 rank(s), in one world of 4:" in r.stdout, r.stdout
    assert "replica 0: node(s) [0, 1], world ranks 0..1\n" in r.stdout, r.stdout
    assert "replica 1: node(s) [2, 3], world ranks 2..3 <- this node\n" in r.stdout, r.stdout
    r = doctor(
        "--quick",
        "--nnodes",
        "2",
        "--dp",
        "4",
        "--tp",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--insecure",
    )
    assert "node 1 of 2, 4 rank(s) here" in r.stdout, r.stdout
    assert "replica 3: node(s) [1], world ranks 6..7 <- this node (leads it)" in r.stdout, r.stdout


@pytest.mark.timeout(90)
def test_on_a_gpu_node_it_shows_each_workers_device_and_cpus_and_what_nccl_needs(tmp_path) -> None:
    """A GPU node's files (a tree of the test's own): the devices seen with their UUID and NUMA node, each
    worker's place under numa_bind=auto, the checks NCCL and CUDA need; a node short of devices fails."""
    from tests.support.topology import fake_topology, uuid_of

    env = {"RAYFREE_TOPOLOGY_ROOT": str(fake_topology(tmp_path, [0, 1], {0: "0", 1: "1"}))}
    env = {**env, "CUDA_VISIBLE_DEVICES": "1,0"}
    r = doctor("--quick", "--tp", "2", "--numa-bind", "auto", "--master-port", str(_free_port()), env=env)
    devices = line(r.stdout, "devices")
    assert "[ ok ]" in devices and f"1 ({uuid_of(1)}, NUMA 1), 0 ({uuid_of(0)}, NUMA 0)" in devices, r.stdout
    assert "worker 0: device 0, cpus 1; worker 1: device 1, cpus 0" in devices, devices
    for name in ("nccl shm", "ipc namespace", "memlock"):
        assert line(r.stdout, name), r.stdout
    assert "device=auto (cuda): 2 visible" in devices, devices
    r = doctor("--quick", "--tp", "4", "--device", "cuda", "--master-port", str(_free_port()), env=env)
    devices = line(r.stdout, "devices")
    assert r.returncode == 1 and "[FAIL]" in devices and "runs 4 worker(s) but sees 2 device(s)" in devices
    r = doctor("--quick", "--tp", "4", "--master-port", str(_free_port()), env=env)  # (auto: the CPU, said so)
    devices = line(r.stdout, "devices")
    assert "[ ok ]" in devices and "device=auto (cpu)" in devices and "they run on the CPU" in devices, devices
    r = doctor("--quick", "--tp", "2", "--device", "cpu", "--master-port", str(_free_port()), env=env)
    devices = line(r.stdout, "devices")
    assert "[ ok ]" in devices and "device=cpu: 2 GPU(s) on this node; device=cpu: no GPU" in devices, devices


def test_the_collectives_address_is_warned_of_when_public() -> None:
    from rayfree.cli.doctor_gpu import check_collectives_address

    assert check_collectives_address("10.1.2.3").status == "ok"
    public = check_collectives_address("8.8.8.8")
    assert public.status == "warn" and "neither authenticated nor encrypted" in public.detail and public.fix


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root (a UTS namespace)")
@pytest.mark.timeout(90)
def test_a_hostname_that_resolves_to_loopback_is_named_with_the_variable_that_fixes_it() -> None:
    """gloo finds its own address from the hostname: one that resolves to 127.0.0.1 (a hostname of 'localhost',
    a Debian /etc/hosts' 127.0.1.1 line) makes every multi-node world fail in connectFullMesh."""

    def under(hostname: str, env: dict[str, str]) -> str:
        env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        r = subprocess.run(
            ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$0" -m rayfree.cli doctor --quick '
             f'--master-port {_free_port()}', sys.executable],
            capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        return line(r.stdout, "socket ifname") + "\n" + r.stdout

    bare = {"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": None}
    loop = under("localhost", bare)
    assert "[warn] socket ifname" in loop and "'localhost' resolves to 127.0.0.1, a loopback address" in loop, loop
    assert "connectFullMesh" in loop and "fix: set GLOO_SOCKET_IFNAME=" in loop, loop
    unknown = under("rf-no-such-host-name", bare)
    assert "[warn] socket ifname" in unknown and "does not resolve" in unknown, unknown
    named = under("localhost", {"GLOO_SOCKET_IFNAME": "lo"})  # (the variable set: gloo takes that interface)
    assert "GLOO_SOCKET_IFNAME=lo" in named.splitlines()[0] and "loopback" not in named.splitlines()[0], named
