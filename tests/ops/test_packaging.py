"""The house: one import root in the wheel, imports that point down the layers, one settings table."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile

import pytest

from rayfree import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: folder -> its rank in the layering; an import may only go to a lower rank
LAYERS = {"transport": 0, "cluster": 1, "worker": 2, "executor": 3}
#: leaf helpers under the root that every layer may use (they import no layer)
LEAVES = {"rayfree.settings", "rayfree.imports", "rayfree.logs", "rayfree.procs", "rayfree"}


@pytest.mark.timeout(300)
def test_the_wheel_installs_only_rayfree_at_the_top_level(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), ROOT],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(tmp_path / wheels[0]) as z:
        names = z.namelist()
        top_level = z.read(next(n for n in names if n.endswith("top_level.txt"))).decode().split()
    assert top_level == ["rayfree"]
    tops = {n.split("/")[0] for n in names}
    assert tops == {"rayfree", wheels[0].split("-")[0] + "-" + wheels[0].split("-")[1] + ".dist-info"}, tops
    for layer in (*LAYERS, "cli"):
        assert f"rayfree/{layer}/__init__.py" in names, layer
    assert "rayfree/py.typed" in names and "rayfree/transport/py.typed" in names
    assert "rayfree/integrations/vllm/executor.py" in names  # the optional extra's code ships; vLLM does not


def _imports(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_imports_point_down_the_layers_and_never_at_the_old_top_level_names() -> None:
    bad = []
    for layer, rank in LAYERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, layer)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                for mod in _imports(path):
                    head = mod.split(".")[0]
                    if head in LAYERS or head == "examples":
                        bad.append(f"{os.path.relpath(path, ROOT)} imports top-level {mod!r}")
                    if head != "rayfree" or mod in LEAVES:
                        continue
                    target = mod.split(".")[1] if "." in mod else ""
                    if target in ("cli", "integrations") or (target in LAYERS and LAYERS[target] > rank):
                        bad.append(f"{os.path.relpath(path, ROOT)} ({layer}) imports {mod} from above")
    assert not bad, "\n".join(bad)


def test_a_layer_folder_imported_as_a_top_level_package_refuses() -> None:
    r = subprocess.run([sys.executable, "-c", "import transport"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "import rayfree.transport, not transport" in r.stderr, r.stderr


def test_every_knob_in_the_code_is_a_setting() -> None:
    """(The settings page is generated from the table: tests/ops/test_docs.py.)"""
    from rayfree.cluster.config import _CLUSTER_FIELDS, _PARALLEL_FIELDS, ENV_PREFIX

    config_vars = {ENV_PREFIX + f.upper() for f in _CLUSTER_FIELDS | _PARALLEL_FIELDS}
    used = set()
    for pkg in (*LAYERS, "rayfree"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f)) as fh:
                        used |= set(re.findall(r"\bRAYFREE_[A-Z0-9_]*[A-Z0-9]\b", fh.read()))
    unknown = used - set(settings.TABLE) - config_vars
    assert not unknown, f"knobs read somewhere but not in rayfree/settings.py: {sorted(unknown)}"


def test_a_setting_that_does_not_parse_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="RAYFREE_SPIN_US='fast'"):
        settings.get("RAYFREE_SPIN_US", {"RAYFREE_SPIN_US": "fast"})
    assert settings.get("RAYFREE_SPIN_US", {}) == 200.0
    assert settings.get("RAYFREE_INSECURE", {"RAYFREE_INSECURE": "yes"}) is True
    assert settings.get("RAYFREE_COPY_THREADS", {}) == min(4, os.cpu_count() or 1)
