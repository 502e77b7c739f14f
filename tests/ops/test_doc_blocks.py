"""Every code block in README.md and docs/ that imports or runs something is run: the Python snippets here, as
written (their free names, `batch` and the like, given by the test), against the docs' own engine
(examples/my_engine); the multi-node commands on simulated nodes, as written (10.0.0.1 becomes node 0's address,
`$K` the node's rank); what needs what this machine cannot run in this suite (vLLM, a real Slurm, Kubernetes,
SkyPilot, `make` itself) by the test named for it, which must exist and run that command or file."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from rayfree.transport import get_open_port
from tests.support.nodes import NodeProc, shm_files, wait_group_empty

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
GENERATED = {"docs/api.md", "docs/settings.md"}
#: fences that show output or layout, not code
NOT_CODE = {"", "text"}


def blocks() -> dict[str, tuple[str, str]]:
    """'page: first line' -> (language, code) of every fenced block."""
    out = {}
    for path in ["README.md", *sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True))]:
        if path in GENERATED:
            continue
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            lang, code = m.group(1), m.group(2)
            if lang not in NOT_CODE:
                out[f"{path}: {code.splitlines()[0].strip()}"] = (lang, code)
    return out


#: Python snippets run here: block -> the names the snippet takes as given
PYTHON = {
    "README.md: from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig": "engine",
    "docs/engines.md: from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig": "engine",
    "docs/architecture.md: import threading": "plain",
    "docs/architecture.md: import os": "two ranks",
}
#: excerpts of a file a test runs whole: block -> the file (the block must be in it, verbatim)
EXCERPTS = {
    "docs/workers.md: class TPLinearWorker(WorkerBase):": "examples/tp_layer.py",
    "docs/workers.md: config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=tp))": "examples/tp_layer.py",
    "docs/workers.md: class HFLlamaWorker(WorkerBase):": "examples/hf_llama_tp.py",
    "docs/engines.md: from itertools import count": "examples/dp_router.py",
}
#: shell blocks run here on simulated nodes: block -> (nodes, what node 0's output must show)
CLUSTERS = {
    "README.md: rayfree keygen rayfree.secret        # once, copied to every node": (2, "10 of 10 steps equal"),
    "docs/operations.md: rayfree keygen rayfree.secret      # once; copy it to every node (see Security)": (
        2,
        "10 of 10 steps equal",
    ),
    "docs/operations.md: # DP=2 replicas of TP=2, each over two nodes: replica 0 = nodes 0-1, replica 1 = nodes 2-3": (
        4,
        "replica 0: 10 of 10 steps equal",
    ),
    "docs/launchers/torchrun.md: torchrun --nnodes 2 --nproc-per-node 1 --node-rank $K --master-addr 10.0.0.1 --master-port 29500 \\": (  # noqa: E501
        2,
        "10 of 10 steps equal",
    ),
}
#: run once, here: block -> what it must print
COMMANDS = {
    "docs/operations.md: rayfree keygen rayfree.secret            # once; copy the file (mode 0600) to every node": (
        "wrote a new cluster secret"
    ),
}
#: engine-author test code run here as the page says: block -> the command that runs it
PAGES_TESTS = {
    "docs/testing.md: from rayfree.testing import simulated_cluster": "examples",
    "docs/testing.md: cd examples && pytest test_simulated_cluster.py": "examples",
}
#: run elsewhere: block -> (the file that runs it, what that file must contain: the command or file it runs), as
#: many pairs as it takes
ELSEWHERE = {
    "README.md: make demo    # fresh machine: creates .venv (torch 2.13.0 CPU build + rayfree), runs the demo": (
        ".ci/run",
        "make test",
    ),
    "docs/index.md: make demo    # fresh machine: creates .venv (torch 2.13.0 CPU build + rayfree), runs the demo": (
        ".ci/run",
        "make docs",
    ),
    "README.md: from vllm import LLM": ("tests/vllm/test_vllm.py", "README.md"),
    "docs/vllm.md: from vllm import LLM": ("tests/vllm/test_vllm.py", "docs/vllm.md"),
    "docs/vllm.md: rayfree keygen rayfree.secret                        # once, copied to every node": (
        "tests/vllm/test_vllm.py",
        "--distributed-executor-backend",
    ),
    "docs/launchers/slurm.md: rayfree keygen ~/.rayfree.secret                 # once, where every node can read it": (
        "tests/slurm/test_slurm.py",
        '"rayfree.sbatch"',
        "tests/vllm/test_vllm.py",
        '"vllm.sbatch"',
    ),
    "docs/launchers/slurm.md: srun --ntasks-per-node=1 --kill-on-bad-exit=1 rayfree node": (
        "deploy/slurm/rayfree.sbatch",
        "--kill-on-bad-exit=1",
    ),
    "docs/launchers/kubernetes.md: rayfree keygen rayfree.secret": ("tests/ops/test_k8s.py", "lws.yaml"),
    "docs/launchers/skypilot.md: num_nodes: 2": ("tests/cluster/test_launch.py", "SKYPILOT_NODE_RANK"),
}


def test_every_block_that_imports_or_runs_something_is_run_somewhere() -> None:
    found = blocks()
    known = {**PYTHON, **EXCERPTS, **CLUSTERS, **COMMANDS, **PAGES_TESTS, **ELSEWHERE}
    assert len(found) > 15  # the walk found the pages
    assert not set(found) - set(known), f"blocks nobody runs: {sorted(set(found) - set(known))}"
    assert not set(known) - set(found), f"blocks listed here but gone from the docs: {sorted(set(known) - set(found))}"


@pytest.mark.parametrize("block", sorted(ELSEWHERE))
def test_a_block_run_elsewhere_is_run_by_the_file_named_for_it(block: str) -> None:
    pairs = ELSEWHERE[block]
    for path, needle in zip(pairs[::2], pairs[1::2]):
        with open(os.path.join(ROOT, path)) as f:
            assert needle in f.read(), f"{path} does not run {needle!r} (for the block {block!r})"


@pytest.mark.parametrize("block", sorted(EXCERPTS))
def test_an_excerpt_is_verbatim_in_the_file_a_test_runs(block: str) -> None:
    _, code = blocks()[block]
    with open(os.path.join(ROOT, EXCERPTS[block])) as f:
        assert code in f.read(), f"{block!r} is not verbatim in {EXCERPTS[block]}"


ENGINE_GIVEN = """
from rayfree.cli.toy_engine import make_batch
batch = make_batch(0)
x = "an adapter"
class _Engine:
    stopped = 0
    def stop(self):
        _Engine.stopped += 1
engine = _Engine()
"""


def _env(**more: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, EXAMPLES]),
        "RAYFREE_MASTER_PORT": str(get_open_port("127.0.0.1")),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        **more,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", sorted(PYTHON))
def test_a_python_block_runs_as_written(block: str, tmp_path) -> None:
    _, code = blocks()[block]
    given = PYTHON[block]
    script = tmp_path / "block.py"
    if given == "engine":  # an engine's code runs under its main guard (spawned workers import the main module)
        body = "".join("    " + ln if ln.strip() else ln for ln in (ENGINE_GIVEN + code).splitlines(True))
        code = f"def main():\n{body}\n\nif __name__ == '__main__':\n    main()\n"
    script.write_text(code)
    if given == "two ranks":
        env = _env(WORLD_SIZE="2")
        procs = [
            subprocess.Popen([sys.executable, str(script)], cwd=EXAMPLES, env={**env, "RANK": str(r)}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(2)
        ]  # fmt: skip
        outs = [p.communicate(timeout=150)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
        return
    r = subprocess.run(
        [sys.executable, str(script)], cwd=EXAMPLES, env=_env(), capture_output=True, text=True, timeout=150
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", sorted(COMMANDS))
def test_a_command_runs_as_written(block: str, tmp_path) -> None:
    _, code = blocks()[block]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    r = subprocess.run(["sh", "-ec", code], cwd=tmp_path, env={**_env(), "PATH": path}, capture_output=True,
                       text=True, timeout=50)  # fmt: skip
    assert r.returncode == 0 and COMMANDS[block] in r.stdout, r.stdout + r.stderr


def _commands(code: str) -> list[str]:
    """The block's commands, one per line (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [ln.split(" #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _node_of(command: str) -> int | None:
    m = re.search(r"--node-rank (\$K|\d+)", command)
    return None if m is None else (-1 if m.group(1) == "$K" else int(m.group(1)))


@contextlib.contextmanager
def _removed(path: str):
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", sorted(CLUSTERS))
def test_a_multi_node_block_forms_its_cluster_on_simulated_nodes(block: str, tmp_path) -> None:
    _, code = blocks()[block]
    nnodes, want = CLUSTERS[block]
    cmds = _commands(code)
    setup = [c for c in cmds if _node_of(c) is None]  # the secret, shell variables: once, on this machine
    per_node = [c for c in cmds if _node_of(c) is not None]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    # What the block's tools keep in a temporary directory (torchrun's logs among them) goes in one of the test's
    # own, removed after it; a short path: ipc:// endpoints are made there too.
    scratch = tempfile.mkdtemp(prefix="rf-doc-")
    with SimulatedCluster(nnodes) as sim, _removed(scratch):
        ip = sim.nodes[0].ip
        env = {**_env(), "PATH": path, "RAYFREE_LOG_LEVEL": "INFO", "TMPDIR": scratch}
        made = {m for c in setup for m in re.findall(r"keygen (\S+)", c)}
        wanted = set(re.findall(r"--secret-file ([^\s\"]+)", code))
        setup = [*(f"rayfree keygen {f}" for f in sorted(wanted - made)), *setup]  # the page says to make it once
        once = "; ".join(c.replace("10.0.0.1", ip) for c in setup)
        subprocess.run(["sh", "-ec", once or "true"], cwd=tmp_path, env=env, check=True, timeout=60)
        prelude = "; ".join(c.replace("10.0.0.1", ip) for c in setup if re.match(r"^\w+=", c))  # the variables
        if any(_node_of(c) == -1 for c in per_node):  # one command with $K for every node
            per_node = [per_node[0].replace("$K", str(k)) for k in range(nnodes)]
        assert sorted(_node_of(c) for c in per_node) == list(range(nnodes)), per_node
        procs: list[NodeProc] = []
        for c in sorted(per_node, key=_node_of):
            line = c.replace("10.0.0.1", ip)
            shell = f"{prelude}; exec {line}" if prelude else f"exec {line}"
            procs.append(
                NodeProc(
                    sim.nodes[_node_of(c)], ["sh", "-ec", f"cd {shlex.quote(str(tmp_path))}; {shell}"], env
                ).start()
            )
            procs[-1].others = procs
        procs[0].expect(re.escape(want), 240)
        codes = [p.wait(120) for p in procs]
        t0 = time.monotonic()
        for p in procs:
            assert not wait_group_empty(p.p.pid, 15) and not shm_files(p.node)
        assert time.monotonic() - t0 < 30
    assert codes == [0] * nnodes, procs[0].text()[-3000:] + procs[0].others_text()


@pytest.mark.timeout(600)
def test_the_testing_pages_test_and_command_pass_as_written(tmp_path) -> None:
    """docs/testing.md's test function, in a file of its own beside examples/my_engine, and its command (the
    worked example's pytest run is tests/ops/test_examples.py's; here the page's own snippet)."""
    found = blocks()
    _, code = found["docs/testing.md: from rayfree.testing import simulated_cluster"]
    test = tmp_path / "test_page.py"
    test.write_text(code)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(test)],
        cwd=EXAMPLES, env=_env(), capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    _, command = found["docs/testing.md: cd examples && pytest test_simulated_cluster.py"]
    assert command.strip() == "cd examples && pytest test_simulated_cluster.py"
    with open(os.path.join(ROOT, "tests", "ops", "test_examples.py")) as f:
        runner = f.read()
    assert '"test_simulated_cluster.py"' in runner and 'os.path.join(ROOT, "examples")' in runner
