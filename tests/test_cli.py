"""The `rayfree` command."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str, timeout: float = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayfree.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_version_and_help() -> None:
    v = run("--version")
    assert v.returncode == 0 and v.stdout.startswith("rayfree ")
    h = run("--help")
    assert h.returncode == 0 and "demo" in h.stdout


@pytest.mark.timeout(180)
def test_transport_demo_runs_and_verifies_every_payload() -> None:
    r = run("demo", "--transport", "--readers", "2", "--remote", "1", "--messages", "60", timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all payloads verified" in r.stdout
    assert "shm" in r.stdout and "tcp" in r.stdout


@pytest.mark.timeout(180)
def test_engine_demo_on_one_node_checks_every_step_and_prints_the_table(tmp_path) -> None:
    # Run from a directory whose own modules carry the names of rayfree's layers: none may be imported.
    for name in ("worker", "executor", "cluster", "transport", "examples"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the user\\'s {name}.py was imported')\n")
    r = run("demo", "--nodes", "1", "--steps", "40", timeout=170, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TP=2 x PP=2 = 4 workers on this node" in r.stdout
    assert "all outputs match the single-process model; workers exited cleanly" in r.stdout
    for row in ("step latency p50", "step latency p99", "executor overhead p50"):
        assert row in r.stdout


@pytest.mark.timeout(180)
def test_default_demo_runs_two_simulated_nodes_and_leaves_nothing() -> None:
    r = run("demo", "--steps", "30", timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 2 simulated nodes" in r.stdout
    table = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit() and "Worker" in ln]
    assert [row[0] for row in table] == ["0", "1", "2", "3"] and [row[1] for row in table] == ["0", "0", "1", "1"]
    assert "step latency p99" in r.stdout and "outputs equal to 1-process model          30" in r.stdout
    assert "no process, shm segment or namespace left behind" in r.stdout
