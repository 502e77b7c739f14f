"""`make gpu-check`'s set-up, for GPU machines that are often offline: this machine's own Python and torch (its
CUDA build, which no index gives), rayfree's dependencies from the wheelhouse (`make wheelhouse`), no package
index; then bench/gpu_check.py.

    python3 bench/gpu_env.py VENV WHEELHOUSE [gpu_check.py's arguments]

The venv sees the system's packages (`--system-site-packages`: torch and, where installed, transformers and
vLLM), and pip installs into it only what the system lacks, from the wheelhouse alone (`--no-index`, the host's
pip configuration ignored). A wheel the wheelhouse lacks is named in one line, and the command exits 1. Where
this Python's torch has no CUDA (a CPU machine) it says so; `--offline` runs the same set-up there anyway (its
test: the wheelhouse's own torch is installed then).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what gpu_check.py needs: rayfree's wheel (its dependencies with it; torch is the system's where it has CUDA)
NEEDED = ["rayfree", "numpy"]


def torch_has_cuda(python: str) -> bool | None:
    """Does `python`'s torch have CUDA (None: no torch)? Asked in a child, which may initialise CUDA."""
    code = "import torch; print(bool(torch.version.cuda) and torch.cuda.is_available())"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    return None if out.returncode != 0 else out.stdout.strip() == "True"


def missing_wheel(text: str) -> str | None:
    m = re.search(r"No matching distribution found for ([^\s]+)", text) or re.search(
        r"Could not find a version that satisfies the requirement ([^\s]+)", text
    )
    return m.group(1) if m else None


def main(argv: list[str]) -> int:
    offline = "--offline" in argv
    argv = [a for a in argv if a != "--offline"]
    if len(argv) < 2:
        print("usage: python3 bench/gpu_env.py VENV WHEELHOUSE [gpu_check.py's arguments]", file=sys.stderr)
        return 2
    venv, wheelhouse, rest = os.path.abspath(argv[0]), os.path.abspath(argv[1]), argv[2:]
    cuda = torch_has_cuda(sys.executable)
    if not cuda and not offline:
        print(f"gpu-check: this Python's torch has no CUDA ({'no torch' if cuda is None else 'a CPU build'}): "
              f"nothing to set up offline; `make gpu-check` on a CPU machine runs from .venv")  # fmt: skip
        return 3
    if not os.path.isdir(wheelhouse) or not any(f.endswith(".whl") for f in os.listdir(wheelhouse)):
        print(f"gpu-check: the wheelhouse {wheelhouse} is empty: fill it with `make wheelhouse` on a machine with "
              f"the package index, and copy it here")  # fmt: skip
        return 1
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True, timeout=300)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wanted = NEEDED  # (CUDA's torch is the system's own: it satisfies rayfree's, and pip keeps it)
    pip = [py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse, *wanted]
    out = subprocess.run(pip, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        name = missing_wheel(out.stdout + out.stderr)
        what = f"has no wheel for {name}" if name else f"could not be installed from: {out.stderr.strip()[-300:]}"
        print(f"gpu-check: the wheelhouse {wheelhouse} {what}: add it with `make wheelhouse` (or `pip download`) on "
              f"a machine with the package index")  # fmt: skip
        return 1
    print(f"gpu-check: {venv} (this Python's packages, the rest from {wheelhouse}, no index)", flush=True)
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([py, os.path.join(ROOT, "bench", "gpu_check.py"), *rest], cwd=ROOT, env=run_env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
