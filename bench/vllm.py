"""vLLM's generate through rayfree vs through vLLM's own `mp` executor, in one run (`make bench-vllm`).

Layouts: TP=2 on one node, and TP=2 over two simulated nodes (one rank each; network namespaces, as
root) where vLLM's mp runs its own multi-node mode (on node 1 what `vllm serve --headless` runs:
tests/support/vllm_mp_follower.py) and rayfree
runs `rayfree node --headless`. Both use the same timed CPU worker (tests/support/vllm_timed.py), one OpenMP
thread per worker (OMP_NUM_THREADS=1: rayfree's default; vLLM's CPU default with
VLLM_CPU_OMP_THREADS_BIND=nobind lets each worker take every core, which on 2 cores measures thread
contention, not the executor), synchronous scheduling, a tiny local Llama (tests/support/vllm_tiny_model.py),
8 prompts x 200 greedy tokens, 5 rounds after a warm-up, mp and rayfree alternating.

Per round: tokens/s; the step time (generate's wall time / steps); the time rank 0's worker spent in
execute_model + sample_tokens; and the rest, "outside": engine + executor per step. The engine is the
same code for both, so the difference between the two "outside" columns is the executors'. Medians
of the rounds are printed, with the ratio rayfree / mp.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rayfree.cluster.simulate import SimulatedCluster, can_use_netns  # noqa: E402
from rayfree.transport.secure import policy as security  # noqa: E402
from tests.support.paths import pythonpath  # noqa: E402 - (once the checkout is on the path)
from tests.support.vllm_engine import ENV, TIMED_WORKER, engine_args  # noqa: E402
from tests.support.vllm_tiny_model import make  # noqa: E402

ENV = {**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(), "TORCH_CPP_LOG_LEVEL": "ERROR"}
PORT = 29500


def _result(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith("BENCH:"):
            return json.loads(line[6:])
    raise RuntimeError("no BENCH line:\n" + out[-4000:])


def one_node(model: str, backend: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "tests.support.vllm_engine", model, backend, "bench"],
        cwd=ROOT,
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    return _result(p.stdout + p.stderr)


def two_nodes(model: str, backend: str, secret: str) -> dict:
    with SimulatedCluster(2) as sim:
        ip0 = sim.nodes[0].ip
        env = {
            **ENV,
            "RAYFREE_SECRET_FILE": secret,
            "RAYFREE_NNODES": "2",
            "RAYFREE_MASTER_ADDR": ip0,
            "RAYFREE_MASTER_PORT": str(PORT),
            "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
        }
        if backend == "mp":
            follower = [sys.executable, "-m", "tests.support.vllm_mp_follower", model, ip0, str(PORT), TIMED_WORKER]
            leader = ["--nnodes", "2", "--master-addr", ip0, "--master-port", str(PORT)]
        else:
            follower = [
                sys.executable,
                "-m",
                "rayfree.cli",
                "node",
                "--headless",
                "--node-rank",
                "1",
                "--worker",
                "rayfree.integrations.vllm:VllmWorker",
                "--worker-kwargs",
                json.dumps({**engine_args(model), "worker_cls": TIMED_WORKER, "async_scheduling": False}),
            ]
            leader = []
        f = sim.nodes[1].popen(
            follower,
            env={**env, "VLLM_HOST_IP": sim.nodes[1].ip},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        lead = sim.nodes[0].popen(
            [sys.executable, "-m", "tests.support.vllm_engine", model, backend, "bench", *leader],
            env={**env, "VLLM_HOST_IP": ip0, "RAYFREE_NODE_RANK": "0"},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = lead.communicate(timeout=900)
        try:  # rayfree's follower stops with node 0; vLLM's keeps serving a leader that is gone
            f.wait(15)
            stopped = True
        except subprocess.TimeoutExpired:
            stopped = False
        return {**_result(out), "follower_stopped": stopped}


def med(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the simulated nodes are removed
    layouts = ["1 node"] + (["2 nodes"] if can_use_netns() else [])
    with tempfile.TemporaryDirectory(prefix="rf-bench-vllm-") as d:
        model = make(os.path.join(d, "tiny-llama"))
        secret = os.path.join(d, "secret")
        security.write_secret(secret)
        print(
            "vLLM generate: rayfree vs vLLM's mp executor, TP=2, 8 prompts x 200 tokens, medians of 5 rounds "
            "(us per step)"
        )
        print(
            f"{'layout':<9}{'executor':<10}{'tokens/s':>10}{'step':>9}{'in model':>10}{'outside':>9}{'outside/mp':>12}"
        )
        for layout in layouts:
            got: dict[str, list[dict]] = {"mp": [], "rayfree": []}
            followers: dict[str, list[bool]] = {"mp": [], "rayfree": []}
            for _ in range(2):  # alternate, so drift on a shared machine hits both
                for backend in ("mp", "rayfree"):
                    t = time.monotonic()
                    r = one_node(model, backend) if layout == "1 node" else two_nodes(model, backend, secret)
                    got[backend] += r["rounds"]
                    followers[backend].append(r.get("follower_stopped", True))
                    print(f"  ({layout}, {backend}: {time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
            if layout != "1 node":
                print(
                    f"  (2 nodes: the follower stopped by itself after node 0 finished: "
                    f"{', '.join(f'{b} {st}' for b, st in followers.items())})",
                    file=sys.stderr,
                )
            base = med(got["mp"], "outside_us")
            for backend in ("mp", "rayfree"):
                rs = got[backend]
                print(
                    f"{layout:<9}{backend:<10}{med(rs, 'tokens_per_s'):>10.0f}{med(rs, 'step_us'):>9.0f}"
                    f"{med(rs, 'model_us'):>10.0f}{med(rs, 'outside_us'):>9.0f}"
                    f"{med(rs, 'outside_us') / base:>12.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
