"""A worker class path checked from its module's source, so the node process that only starts workers never
imports the engine (and torch with it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rayfree.imports import SpecError, check_spec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    (tmp_path / "eng").mkdir()
    (tmp_path / "eng" / "__init__.py").write_text("")
    (tmp_path / "eng" / "work.py").write_text(
        textwrap.dedent(
            """
            import torch  # (never run by the check)
            from os import path as P

            class Worker: pass

            def make(): pass

            try:
                from json import loads as Fast
            except ImportError:
                Fast = None
            if True:
                class Later: pass
            ALIAS = Worker
            """
        )
    )
    (tmp_path / "eng" / "lazy.py").write_text("def __getattr__(name): return object\n")
    (tmp_path / "eng" / "made.py").write_text("globals()['Made'] = type('Made', (), {})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", ["Worker", "Worker.method", "Fast", "Later", "ALIAS", "P"])
def test_a_name_the_source_defines_or_imports_is_found_without_running_it(pkg, name) -> None:
    assert check_spec(f"eng.work:{name}", "worker class") is True
    assert "eng.work" not in sys.modules


def test_a_missing_name_or_a_function_for_a_class_is_refused_by_name(pkg) -> None:
    with pytest.raises(SpecError, match="'eng.work' has no 'Nope'"):
        check_spec("eng.work:Nope", "worker class")
    with pytest.raises(SpecError, match="'make' in 'eng.work' is a function, not a class"):
        check_spec("eng.work:make", "worker class")
    with pytest.raises(SpecError, match="write it as 'package.module:Name'"):
        check_spec("eng.work", "worker class")


def test_what_the_source_cannot_tell_is_left_to_an_import(pkg) -> None:
    assert check_spec("eng.lazy:Anything", "worker class") is None  # a module-level __getattr__
    assert check_spec("eng.made:Made", "worker class") is None  # names made as it runs
    assert check_spec("no_such_pkg.mod:X", "worker class") is None  # not here: the workers' machines may have it


def test_the_node_process_does_not_import_torch_to_check_the_toy_engine_s_class() -> None:
    code = (
        "import sys; from rayfree.worker.proc import check_worker_path; "
        "check_worker_path('rayfree.cli.toy_engine:ToyWorker'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "entry",
    [
        "rayfree.cli.demo_driver:drive",  # the demo's, and the shipped recipes'
        "bench.coupled:replica_loop",
    ],
)
def test_an_entry_we_ship_or_test_with_has_torch_once_rayfree_node_has_loaded_it(entry: str) -> None:
    # `rayfree node` loads the entry before its heartbeats start; torch imported later, in the entry, would load
    # libtorch holding Python's lock with them live (operations.md, "Entry points"; a CI run lost node 0 so).
    code = (
        "import sys; from rayfree.cli.node_options import load_entry; "
        f"load_entry({entry!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
