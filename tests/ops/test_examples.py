"""The docs' worked examples run, and nothing in the repository points outside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import PYTHONPATH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_tp_layer_example_equals_the_unsharded_layer(tp: int) -> None:
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "tp_layer.py"), str(tp)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "largest difference" in r.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["auto", "mesh"])
def test_a_hugging_face_llama_sharded_with_tp_plan_generates_the_unsharded_models_tokens(how: str) -> None:
    """transformers' own tensor parallelism inside rayfree's workers at TP=2: `tp_plan="auto"` (it reads the
    world from RANK / WORLD_SIZE / LOCAL_RANK, which the workers carry) and a DeviceMesh of the TP group. Each rank
    holds half of every sharded weight, and greedy generation gives the one-process model's tokens."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "hf_llama_tp.py"), how, "2"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "tokens equal to the one-process model: True" in r.stdout, r.stdout
    assert "split as [(32, 64), (32, 64)]" in r.stdout, r.stdout


@pytest.mark.timeout(900)
def test_the_simulated_cluster_example_test_passes() -> None:
    """examples/test_simulated_cluster.py, as an engine author runs it: pytest in that folder, with the
    `rayfree_cluster` fixture from rayfree.testing. Its tests' own bound is the example's waits' (up to 300 s),
    not this repository's 120 s per test: a rejoin took over 120 s beside a second suite."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "timeout=400",
            "test_simulated_cluster.py",
        ],
        cwd=os.path.join(ROOT, "examples"),
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "3 passed" in r.stdout, r.stdout[-2000:]


def test_nothing_in_the_repository_points_outside_it() -> None:
    out = subprocess.run(
        [
            "git",
            "grep",
            "-n",
            "-I",
            "-e",
            "../shared",
            "-e",
            "DESIGN.md",
            "--",
            ".",
            ":(exclude)tests/ops/test_examples.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.stdout == "", out.stdout


@pytest.mark.timeout(180)
def test_the_dp_router_example_routes_around_a_lost_replica() -> None:
    """examples/dp_router.py (docs/engines.md): 200 requests over two independent replicas, one of which loses a
    worker after 50; every request is answered once, the lost replica's are sent again to the other."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "dp_router.py")],
        cwd=os.path.join(ROOT, "examples"),
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "200 requests answered, each once" in r.stdout, r.stdout
    assert "replica changes heard: [(1, 'lost')]; states now: {0: 'serving', 1: 'lost'}" in r.stdout, r.stdout
    # (rank 0 of replica 1 still answers until its peer's death is noticed, within a second: those count)
    after = re.search(r"once its loss was heard of: replica 0 took [1-9]\d*, replica 1 took 0$", r.stdout, re.M)
    assert after, r.stdout
