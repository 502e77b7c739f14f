"""Start-up against torch's own floor, and a clean stop, in pairs whose order flips every round.

- floor: two plain processes that import torch, join a gloo world by env:// and pass one barrier (ready = the
  later of the two past it, from their launch);
- rayfree 1 x 2: a fresh process that builds a MultiprocExecutor of two workers (WorkerBase: the gloo world, the
  groups, the queues, the handshake) and has its first `collective_rpc` answered (from its launch); then its
  clean stop (`shutdown()` until it returns, every worker gone);
- as root, 2 x 1 on two simulated nodes (network namespaces): `rayfree node` on each, ready = node 0's entry
  gets its first call answered (from the first launch); the floor's two processes one per namespace; and the
  clean stop (from the entry's return to the last node's exit).

    python bench/startup.py [--rounds 5] [--no-nodes]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rayfree.cluster.simulate import netns_missing  # noqa: E402 - (once the checkout is on the path)
from tests.support.paths import pythonpath  # noqa: E402

FLOOR = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", world_size=2, rank=int(sys.argv[1]))
dist.barrier()
print("PAST", time.time(), flush=True)
dist.destroy_process_group()
"""

ONE_NODE = """
import sys, time
from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig
ex = MultiprocExecutor(ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2)), "rayfree.worker.base:WorkerBase")
ex.collective_rpc("check_health", timeout=120)
t_ready = time.time()
t = time.perf_counter()
ex.shutdown()
print("RESULT", t_ready, time.perf_counter() - t, flush=True)
"""

ENTRY = """
import json, time

def entry(ex):
    ex.collective_rpc("check_health", timeout=120)
    print("READY", time.time(), flush=True)
    return 0
"""


def _env(**more: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": pythonpath(),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "RAYFREE_LOG_LEVEL": "WARNING",
        **more,
    }


def floor(popen=None, addr: str = "127.0.0.1") -> float:
    """Seconds from launching the two plain processes to the later one past its barrier."""
    from rayfree.transport import get_open_port

    port = str(29400 if popen else get_open_port("127.0.0.1"))
    t0 = time.time()
    procs = []
    for r in range(2):
        argv = [sys.executable, "-c", FLOOR, str(r)]
        env = _env(MASTER_ADDR=addr, MASTER_PORT=port)
        procs.append(
            popen[r](argv, env) if popen else subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        )
    past = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        past += [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("PAST")]
    assert len(past) == 2, "the floor's processes did not both pass the barrier"
    return max(past) - t0


def one_node() -> tuple[float, float]:
    """(ready, clean stop) of rayfree 1 x 2, from launching a fresh process."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", ONE_NODE], env=_env(), capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, out.stdout + out.stderr
    _, t_ready, stop = line.split()
    return float(t_ready) - t0, float(stop)


def two_nodes(sim, entry_dir: str) -> tuple[float, float]:
    """(ready, clean stop) of rayfree 2 x 1 on `sim`'s two nodes."""
    from simnodes import pair_env

    t0 = time.time()
    procs = []
    for k in (1, 0):
        env = pair_env(sim, k, "startup_entry:entry", entry_dir, _env())
        argv = [sys.executable, "-m", "rayfree.cli", "node"]
        procs.append(sim.nodes[k].popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        outs.append((out, time.time()))
    lead_out = outs[1][0]
    line = next((ln for ln in lead_out.splitlines() if ln.startswith("READY")), None)
    assert line and all(p.returncode == 0 for p in procs), "\n---\n".join(o for o, _ in outs)
    t_ready = float(line.split()[1])
    return t_ready - t0, max(t for _, t in outs) - t_ready


def _ratio_line(name: str, ours: list[float], base: list[float]) -> str:
    o, b = statistics.median(ours), statistics.median(base)
    ratios = [x / y for x, y in zip(ours, base)]
    return (
        f"  {name:<10} rayfree {o:5.2f} s   floor {b:5.2f} s   ratio p50 {statistics.median(ratios):.2f} "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-nodes", action="store_true", help="skip the two simulated nodes")
    a = ap.parse_args()
    print(f"start-up against the floor, {a.rounds} round(s), order flipped each round (this machine)", flush=True)
    ours, base, stops = [], [], []
    for i in range(a.rounds):
        for which in ("ours", "floor") if i % 2 == 0 else ("floor", "ours"):
            if which == "ours":
                ready, stop = one_node()
                ours.append(ready)
                stops.append(stop)
            else:
                base.append(floor())
        print(f"    round {i + 1}: rayfree 1x2 {ours[-1]:.2f} s, floor {base[-1]:.2f} s", flush=True)
    print(_ratio_line("1 x 2", ours, base))
    print(f"  clean stop 1 x 2: p50 {statistics.median(stops):.2f} s (max {max(stops):.2f})")
    if a.no_nodes or netns_missing():
        print("  2 x 1: skipped" + ("" if a.no_nodes else f" (network namespaces need {netns_missing()})"))
        return 0
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from rayfree.cluster.simulate import SimulatedCluster

    entry_dir = tempfile.mkdtemp(prefix="rayfree-startup-")
    with open(os.path.join(entry_dir, "startup_entry.py"), "w") as f:
        f.write(ENTRY)
    ours, base, stops = [], [], []
    try:
        with SimulatedCluster(2) as sim:
            popen = [
                lambda argv, env, k=k: sim.nodes[k].popen(argv, env=env, stdout=subprocess.PIPE, text=True)
                for k in (0, 1)
            ]
            for i in range(a.rounds):
                for which in ("ours", "floor") if i % 2 == 0 else ("floor", "ours"):
                    if which == "ours":
                        ready, stop = two_nodes(sim, entry_dir)
                        ours.append(ready)
                        stops.append(stop)
                    else:
                        base.append(floor(popen, sim.nodes[0].ip))
                print(f"    round {i + 1}: rayfree 2x1 {ours[-1]:.2f} s, floor {base[-1]:.2f} s", flush=True)
    finally:
        import shutil

        shutil.rmtree(entry_dir, ignore_errors=True)
    print(_ratio_line("2 x 1", ours, base))
    print(f"  clean stop 2 x 1 (entry returned -> last node out): p50 {statistics.median(stops):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
