"""Teardown after a lost node, by node count: from the kill to the last surviving node's exit.

N simulated nodes x 1 rank (root: network namespaces), started as `rayfree node` starts them with the echo
worker in a gloo world, sealed, at the default heartbeat and shutdown settings. Node 0's entry calls every
rank without pause; then the last node is SIGKILLed. Printed per N: when node 0's call failed (the loss
known), and when the last of the other nodes' processes had exited (their workers stopped, their segments
released: the cluster torn down), both from the kill.

    python bench/teardown.py [--nodes 2,4,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import has_netns, start_nodes, write_json  # noqa: E402


def calls_until_lost(ex) -> int:
    """Node 0's entry: calls every rank until the cluster fails; says when."""
    from rayfree import ExecutorError

    print("STEPPING:" + json.dumps({"t": time.monotonic()}), flush=True)
    try:
        while True:
            ex.collective_rpc("echo", args=(b"x",), timeout=60)
    except ExecutorError as e:
        print("LOST:" + json.dumps({"t": time.monotonic(), "kind": type(e).__name__}), flush=True)
    return 1


def once(n: int) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    with SimulatedCluster(n) as sim:
        procs, _others = start_nodes(sim, 1, "bench.teardown:calls_until_lost")
        lines: list[str] = []
        for line in procs[0].stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("STEPPING:"):
                break
        else:
            raise RuntimeError("node 0 never stepped:\n" + "".join(lines[-40:]))
        time.sleep(1.0)  # (a bench: calls flow first)
        t_kill = time.monotonic()
        sim.nodes[n - 1].kill(signal.SIGKILL)
        exits: dict[int, float] = {}
        until = t_kill + 120
        while len(exits) < n - 1 and time.monotonic() < until:
            for k, p in enumerate(procs[:-1]):
                if k not in exits and p.poll() is not None:
                    exits[k] = time.monotonic() - t_kill
            time.sleep(0.01)
        rest = procs[0].stdout.read()  # type: ignore[union-attr]
        lost = next((json.loads(x[5:]) for x in rest.splitlines() if x.startswith("LOST:")), None)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    return {"n": n, "known_s": lost["t"] - t_kill if lost else None, "last_exit_s": max(exits.values(), default=None),
            "exits": exits}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not has_netns("teardown.py"):
        return 2
    rows = []
    for _ in range(a.rounds):
        for n in (int(x) for x in a.nodes.split(",")):
            rows.append(once(n))
            r = rows[-1]
            print(f"  {n} nodes: loss known {r['known_s']:.2f} s, the last node out {r['last_exit_s']:.2f} s")
    print("\nteardown after a lost node (the last node SIGKILLed), median of the rounds:")
    for n in sorted({r["n"] for r in rows}):
        mine = [r for r in rows if r["n"] == n]
        known = statistics.median(r["known_s"] for r in mine)
        last = statistics.median(r["last_exit_s"] for r in mine)
        print(f"  {n:>3} nodes: loss known {known:.2f} s; every other node exited {last:.2f} s after the kill")
    write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
