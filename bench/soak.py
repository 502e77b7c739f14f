"""Soak: 8 simulated nodes at the default heartbeat settings, every core kept busy, no false loss; then a kill.

A busy loop per core (at the cluster's own priority) runs for the whole soak, while node 0's entry point
calls `collective_rpc` to every rank without pause. Passes when no node was declared lost during the soak
and, once one node is killed at its end, node 0 names that node within the detection bound.

    python bench/soak.py [--minutes 10] [--nodes 8] [--bound 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import start_nodes  # noqa: E402


def soak(ex) -> int:
    """Node 0's entry: calls until RF_SOAK_S passed (any failure is a false alarm), then calls until lost."""
    from rayfree import ExecutorError

    print("SOAK_READY", flush=True)  # the busy loops start now
    until = time.monotonic() + float(os.environ["RF_SOAK_S"])
    calls, worst, error = 0, 0.0, ""
    try:
        while time.monotonic() < until:
            t = time.perf_counter()
            ex.collective_rpc("ack", args=(b"x",), timeout=60)
            worst = max(worst, time.perf_counter() - t)
            calls += 1
    except ExecutorError as e:
        error = f"{type(e).__name__}: {e}"
    print("SOAKED:" + json.dumps({"calls": calls, "worst_call_s": worst, "error": error}), flush=True)
    if error:
        return 1
    t_fail, kind, msg = 0.0, "", ""
    try:
        while True:
            ex.collective_rpc("ack", args=(b"x",), timeout=60)
    except ExecutorError as e:
        t_fail, kind, msg = time.monotonic(), type(e).__name__, str(e)
    print("LOST:" + json.dumps({"t_fail": t_fail, "kind": kind, "error": msg}), flush=True)
    return 0


def _burners() -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--bound", type=float, default=1.0, help="detection bound after the kill, seconds")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from rayfree.cluster.simulate import SimulatedCluster, can_use_netns, netns_missing

    if not can_use_netns():
        print(f"bench/soak.py: simulated nodes need network namespaces; this machine lacks {netns_missing()}",
              file=sys.stderr)  # fmt: skip
        return 2
    n = args.nodes
    burners: list[subprocess.Popen] = []
    with SimulatedCluster(n) as sim:
        outs: list[list[str]] = [[]]
        # no hang without a bound: past the soak and start-up's own time, every node is killed (and this fails)
        watchdog = threading.Timer(args.minutes * 60 + 600, sim.kill_all)
        watchdog.daemon = True
        watchdog.start()
        try:
            procs, others = start_nodes(sim, 1, os.path.abspath(__file__) + ":soak", RF_SOAK_S=str(args.minutes * 60))
            outs += others
            lines = iter(procs[0].stdout)  # type: ignore[arg-type]
            got: dict[str, Any] = {}
            burning = False
            t_start = time.monotonic()
            for line in lines:
                outs[0].append(line)
                if line.startswith("SOAKED:"):
                    got["soak"] = json.loads(line[7:])
                    break
                if not burning and line.startswith("SOAK_READY"):
                    burners, burning = _burners(), True
                    print(
                        f"cluster of {n} nodes up after {time.monotonic() - t_start:.0f}s; "
                        f"{len(burners)} CPU burner(s) on for {args.minutes:g} min",
                        flush=True,
                    )
            if "soak" not in got:
                raise RuntimeError("node 0 stopped before the soak ended:\n" + "".join(outs[0][-40:]))
            print(f"soak: {got['soak']}", flush=True)
            if got["soak"]["error"]:
                print("FAILED: a node was declared lost during the soak", flush=True)
                return 1
            victim = n - 1
            t_kill = time.monotonic()
            sim.nodes[victim].kill(signal.SIGKILL)
            for line in lines:
                outs[0].append(line)
                if line.startswith("LOST:"):
                    got["lost"] = json.loads(line[5:])
                    break
            lost = got.get("lost")
            if lost is None:
                raise RuntimeError("node 0 never reported the kill:\n" + "".join(outs[0][-40:]))
            took = lost["t_fail"] - t_kill
            named = f"node {victim} (" in lost["error"]
            print(
                f"node {victim} killed: node 0 failed its call after {took:.2f} s ({lost['kind']}); "
                f"names node {victim}: {named}",
                flush=True,
            )
            ok = lost["kind"] == "NodeLost" and named and took <= args.bound
            print("PASSED" if ok else f"FAILED: detection {took:.2f}s against {args.bound}s, named={named}")
            return 0 if ok else 1
        finally:
            watchdog.cancel()
            for b in burners:
                b.kill()
                b.wait()
            sim.kill_all()


if __name__ == "__main__":
    sys.exit(main())
