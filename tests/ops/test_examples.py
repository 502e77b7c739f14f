"""The docs' worked examples run, and nothing in the repository points outside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_tp_layer_example_equals_the_unsharded_layer(tp: int) -> None:
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "tp_layer.py"), str(tp)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "largest difference" in r.stdout


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
