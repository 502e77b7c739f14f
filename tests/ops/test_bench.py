"""The executor bench still runs end to end (benches are not in CI otherwise, and rot quietly).

No timing is asserted: only that both rigs came up, every payload arrived whole (the bench's
`nbytes` check raises otherwise), each row was printed and the rigs' processes were pinned alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_rpc_bench_runs_and_prints_every_row() -> None:
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "rpc.py"),
        "--quick",
        "--workers",
        "1,2",
        "--payloads",
        "tiny,64KiB",
        "--rounds",
        "2",
        "--no-startup",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"bench/rpc.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?\d+)%$", out.stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [("1", "tiny"), ("1", "64KiB"), ("2", "tiny"), ("2", "64KiB")], out.stdout
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out.stdout
    if hasattr(os, "sched_setaffinity"):
        assert "2 worker(s): caller on core" in out.stdout, out.stdout


@pytest.mark.timeout(300)
def test_transport_bench_runs_and_measures_the_fences() -> None:
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "transport.py"),
        "--quick",
        "--payloads",
        "tiny,64KiB",
        "--configs",
        "local1,remote1",
        "--no-paced",
        "--remote-readers",
        "1",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"bench/transport.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^(local|remote)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)", out.stdout, re.M)
    assert [(r[0], r[2]) for r in rows] == [
        ("local", "tiny"),
        ("local", "64KiB"),
        ("remote", "tiny"),
        ("remote", "64KiB"),
    ], out.stdout
    fence = re.search(
        r"fence: (\d+) ns per fence; local N=1 tiny round trip p50 ([\d.]+) us with aarch64's "
        r"fences \(8 a round trip\), ([\d.]+) us with this CPU's",
        out.stdout,
    )
    assert fence and float(fence.group(2)) > 0 and float(fence.group(3)) > 0, out.stdout
    times, _, cpu = out.stdout.partition("CPU per message")
    remote = re.findall(r"^\s+1\s+tiny\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", times, re.M)
    assert len(remote) == 1 and all(float(x) > 0 for x in remote[0]), out.stdout  # sealed, insecure, floor
    # writer sealed, insecure, extra, seal; reader sealed, insecure, extra, open (the extras may be negative)
    row = re.findall(r"^\s+1\s+tiny" + r"\s+(-?[\d.]+)" * 8 + r"\s*$", cpu, re.M)
    assert len(row) == 1, out.stdout
    w_sealed, w_insecure, _, seal, _, _, _, open_ = map(float, row[0])
    assert w_sealed > 0 and w_insecure > 0 and seal > 0 and open_ > 0, out.stdout


@pytest.mark.timeout(400)
def test_scale_bench_runs_and_counts_the_copies_out_of_node_0() -> None:
    """Two simulated nodes x two ranks: every row printed; the copies are node 0's interface byte counter,
    a count (flat: one per remote rank; relay: one per node), so they are asserted; the times are not."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "scale.py"), "--nodes", "2", "--ranks", "2", "--quick"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, f"bench/scale.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^\| 2 x 2 \| (\w+) \| ([\d.]+) \|.*\| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["flat", "relay"], out.stdout
    copies = {r[0]: float(r[2]) for r in rows}
    assert 1.9 <= copies["flat"] <= 2.3 and 0.95 <= copies["relay"] <= 1.2, out.stdout
    assert re.search(r"floor \(raw pyzmq .*tiny p50 [\d.]+ us, 1 MiB p50 [\d.]+ ms", out.stdout), out.stdout


@pytest.mark.timeout(300)
def test_control_plane_bench_forms_16_nodes_counts_node_0s_copies_and_finds_the_killed_one() -> None:
    """Sixteen simulated control planes (relay fan-out 8: a tree of depth 2): they form, node 0 sends a 1 MiB
    broadcast once per child node (its interface's byte counter, less the heartbeats': a count, asserted), every
    depth's readers got the tiny broadcasts, and the node killed is the one node 0 finds lost."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "control_plane.py"), "--nodes", "16", "--procs", "2",
           "--rounds", "20", "--load", "0", "--watch", "8"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"bench/control_plane.py failed:\n{out.stdout}\n{out.stderr}"
    row = re.search(r"^ +16 +8 +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +\S+ +\S+ +(\d+) +(\S+) +(.*)$",
                    out.stdout, re.M)  # fmt: skip
    assert row, out.stdout
    assert 7.5 <= float(row.group(5)) <= 8.6, out.stdout  # node 0's 8 child nodes: 8 copies
    assert [d.split(":")[0] for d in row.group(8).split()] == ["0", "1", "2"], out.stdout
    assert row.group(7) != "-", out.stdout  # the killed node was found lost


@pytest.mark.timeout(240)
def test_gpu_check_says_there_is_no_gpu_and_runs_its_plumbing_on_the_cpu(tmp_path) -> None:
    """`make gpu-check` on this machine (no GPU): one line, exit 0, nothing run; `--on-cpu` runs the same script's
    executor, coupled-replica and two-node paths on the CPU, tokens checked against the reference."""
    env = {**os.environ, "RAYFREE_TOPOLOGY_ROOT": str(tmp_path)}  # a node whose driver lists no GPU
    script = os.path.join(ROOT, "bench", "gpu_check.py")
    out = subprocess.run([sys.executable, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "no NVIDIA GPU on this machine" in out.stdout and "TP=" not in out.stdout, out
    out = subprocess.run(  # (its simulated nodes beside the rest of the suite: the link bound STARVED gives)
        [sys.executable, script, "--on-cpu"],
        cwd=ROOT,
        env={**env, "RAYFREE_LINK_TIMEOUT_S": "2.0"},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0 and re.search(r"TP=2 per step p50 \d+ us", out.stdout), f"{out.stdout}\n{out.stderr}"
    assert "DP=2 coupled replicas: 20 steps each, the all-reduce across them on gloo" in out.stdout
    if os.geteuid() == 0:
        assert "two simulated nodes, TP=2 across them" in out.stdout, out.stdout


@pytest.mark.timeout(300)
def test_transport_bench_puts_shared_reads_beside_private_copies_and_memcpy() -> None:
    bench = os.path.join(ROOT, "bench", "transport.py")
    cmd = [sys.executable, bench, "--quick", "--shared", "1,2", "--payloads", "1MiB", "--rounds", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"bench/transport.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^\s+(\d)\s+1MiB\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out.stdout  # private, shared, ratio, memcpy, ratio per N
    assert all(int(r[1]) > 0 and int(r[2]) > 0 and int(r[4]) >= 0 for r in rows), out.stdout


#: the simulated nodes' benches beside the rest of the suite on two cores, whose nodes are lost only by SIGKILL (its
#: connections drop at once, whatever the bound): link and heartbeat bounds past what a starved live node waits for
#: a CPU there, as test_multinode.py's LONG_BOUNDS (with 1 s, CI lost a live replica 0.29 s before node 0's kill in
#: the node-0 failover bench, its calls without pause on every replica; these tests check the plumbing, not timing)
STARVED = {**os.environ, "RAYFREE_LINK_TIMEOUT_S": "12.0", "RAYFREE_HEARTBEAT_TIMEOUT_S": "15"}


@pytest.mark.timeout(300)
def test_failover_bench_loses_one_independent_replica_and_no_call_of_the_other() -> None:
    """DP=2 x TP=1 on two simulated nodes, replica 1's node (its leader) SIGKILLed mid-run: independent, replica 0
    fails no call (a count, asserted; the times are not) and replica 1's node, started again, rejoins; in one
    world, replica 0's pending call ends with NodeLost."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "failover.py"), "--dp", "2", "--tp", "1", "--seconds", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=STARVED)
    assert out.returncode == 0, f"bench/failover.py failed:\n{out.stdout}\n{out.stderr}"
    independent, one_world = out.stdout.split("\none-world: ")
    # replica 0 failed no call, and none was answered wrong, lost by a rank or run twice (sequence numbers)
    assert re.search(r"^  0 +served on +0 +\d+ +\S+ .* 0 +0 +0$", independent, re.M), out.stdout
    assert re.search(r"replica 1's nodes started again: it served again after [\d.]+ s", independent), out.stdout
    assert re.search(r"^  0 +NodeLost after [\d.]+ s +1 ", one_world, re.M), out.stdout


@pytest.mark.timeout(300)
def test_failover_bench_loses_node_0_and_no_call_of_the_other_replicas() -> None:
    """DP=3 x TP=1, independent, on three simulated nodes, node 0 (replica 0's leader) SIGKILLed mid-run, then
    started again: replicas 1 and 2 fail no call through both, and none is answered wrong, lost by a rank or run
    twice (counts, asserted); replica 0 serves again (its time is printed, not asserted), its calls as right."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "failover.py"), "--dp", "3", "--tp", "1", "--seconds", "2",
           "--lose", "node-0", "--couplings", "independent"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=STARVED)
    assert out.returncode == 0, f"bench/failover.py failed:\n{out.stdout}\n{out.stderr}"
    assert "node 0 (replica 0) SIGKILLed" in out.stdout, out.stdout
    served = re.findall(r"^  ([12]) +served on +0 +\d+ +\S+ .* 0 +0 +0$", out.stdout, re.M)
    assert served == ["1", "2"], out.stdout
    assert re.search(r"^  replica 0's nodes started again: it served again after [\d.]+ s", out.stdout, re.M), (
        out.stdout
    )
    assert re.search(r"^  0 +served on +0 +.* 0 +0 +0$", out.stdout, re.M), out.stdout


@pytest.mark.timeout(300)
def test_coupled_bench_shrinks_and_grows_with_every_step_right() -> None:
    """DP=3 x TP=1, coupled, on three simulated nodes: replica 2's node SIGKILLed, then started again. Every step
    of every replica is right (a count, asserted), the survivors have a shrink time and a grow time (the times
    themselves are not asserted), and the rejoined replica steps across all three."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "coupled.py"), "--seconds", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=STARVED)
    assert out.returncode == 0, f"bench/coupled.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^  (\d) +(\d+) +(\d+) +(\d+) +(\S+) +(\S+) +(\S+)$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2"], out.stdout
    assert all(int(r[1]) > 0 and r[2] == "0" for r in rows), out.stdout  # steps taken, none wrong
    assert all(re.fullmatch(r"[\d.]+", r[4]) and re.fullmatch(r"[\d.]+", r[6]) for r in rows[:2]), out.stdout
    assert re.fullmatch(r"[\d.]+", rows[2][6]), out.stdout


@pytest.mark.timeout(300)
def test_elastic_bench_scales_coupled_replicas_out_and_in_with_every_step_right() -> None:
    """DP=3 x TP=1, coupled, on three simulated nodes, scaled 2 -> 3 -> 2 by `rayfree scale`: replicas 0 and 1
    fail no call and get no wrong output (counts, asserted; the bench exits 1 otherwise), each step across every
    replica comes after the scale-out and one across [0, 1] after the scale-in (the times are not asserted)."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "elastic.py"), "--couplings", "coupled", "--window", "1",
           "--pace", "100"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=STARVED)
    assert out.returncode == 0, f"bench/elastic.py failed:\n{out.stdout}\n{out.stderr}"
    assert "DP width 2 -> 3: start node(s) [2]" in out.stdout and "DP width 3 -> 2: replicas [2] drain" in out.stdout
    rows = re.findall(r"^  ([01]) +(\d+) +(\d+) +(\d+) +(\d+) .* ([\d.]+) s +([\d.]+) s$", out.stdout, re.M)
    assert [(r[0], r[1], r[3]) for r in rows] == [("0", "0", "0"), ("1", "0", "0")], out.stdout  # failed, wrong
    assert re.search(r"node 2 exited \[0, 0\]", out.stdout), out.stdout


@pytest.mark.timeout(180)
def test_gpu_check_offline_names_the_wheel_its_wheelhouse_lacks(tmp_path) -> None:
    """`make gpu-check` on an offline machine installs from the wheelhouse alone: an empty one is said in one line,
    and one without rayfree's wheel names it (pip's own error, read for the name), exit 1, no index asked."""
    import zipfile

    script = os.path.join(ROOT, "bench", "gpu_env.py")
    empty = tmp_path / "empty"
    empty.mkdir()

    def run(house) -> subprocess.CompletedProcess:
        argv = [sys.executable, script, "--offline", str(tmp_path / "venv"), str(house), "--on-cpu"]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=170)

    out = run(empty)
    assert out.returncode == 1 and f"the wheelhouse {empty} is empty: fill it with `make wheelhouse`" in out.stdout, out
    house = tmp_path / "house"
    house.mkdir()
    with zipfile.ZipFile(house / "unrelated-1.0-py3-none-any.whl", "w") as z:  # (a valid wheel of something else)
        z.writestr("unrelated/__init__.py", "")
        z.writestr("unrelated-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: unrelated\nVersion: 1.0\n")
        z.writestr("unrelated-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")  # fmt: skip
        z.writestr("unrelated-1.0.dist-info/RECORD", "")
    out = run(house)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("gpu-check:")]
    assert out.returncode == 1 and lines[-1].startswith(f"gpu-check: the wheelhouse {house} has no wheel for "), out
    assert "rayfree" in lines[-1] or "numpy" in lines[-1], lines


@pytest.mark.timeout(300)
def test_step_bench_runs_every_rig_at_every_step_length() -> None:
    cmd = [sys.executable, os.path.join(ROOT, "bench", "step.py"), "--quick", "--rounds", "1", "--rigs",
           "queues,remote,pipe,rpc", "--workers", "1", "--steps-ms", "1,5"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"bench/step.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^\s*(.+?)\s+([\d.]+)\s+(-?\d+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    rigs = ("rayfree queues", "rayfree remote", "blocking pipe", "collective_rpc x1")
    assert [(r[0], r[1]) for r in rows] == [(rig, ms) for ms in ("1", "5") for rig in rigs], out.stdout
    assert "vLLM is not importable here" in out.stdout or "vLLM MessageQueue" in out.stdout, out.stdout


@pytest.mark.timeout(300)
def test_seal_handoff_bench_measures_every_hand_off_against_the_seal_and_insecure() -> None:
    cmd = [sys.executable, os.path.join(ROOT, "bench", "seal_handoff.py"), "--rounds", "1", "--messages", "5"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"bench/seal_handoff.py failed:\n{out.stdout}\n{out.stderr}"
    rows = dict(re.findall(r"^\s*([\w ]+): cpu\s+(\d+)", out.stdout, re.M))
    assert list(rows) == ["seal only", "insecure", "tracked", "owned", "copied"], out.stdout
    assert all(int(v) > 0 for v in rows.values()), rows
    assert out.stdout.count("over insecure") == 3, out.stdout


@pytest.mark.timeout(300)
def test_step_bench_times_collective_rpc_over_two_simulated_nodes() -> None:
    """The nodes rig: node 0's entry is the caller there and times its own calls; each step length gets its row
    (the bench raises if node 0 ended before printing one), with the CPU node 0's process spent meanwhile."""
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        pytest.skip("needs root for network namespaces")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "step.py"), "--quick", "--rounds", "1", "--rigs", "nodes",
           "--steps-ms", "1,5"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=STARVED)
    assert out.returncode == 0, f"bench/step.py failed:\n{out.stdout}\n{out.stderr}"
    rows = re.findall(r"^\s*(rpc 2 nodes)\s+([\d.]+)\s+(-?\d+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    assert [r[1] for r in rows] == ["1", "5"], out.stdout
    assert all(float(r[4]) > 0 for r in rows), out.stdout  # the caller's process ran while it waited
