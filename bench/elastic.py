"""Scaling DP out and in at runtime on simulated nodes: what a change of the width costs the replicas that serve.

DP=3 x TP=1 over three simulated nodes (root: network namespaces), started as `rayfree node` starts them with the
toy model (`replica_coupling` independent, or coupled: every step all-reduces across the replicas, the members it
summed checked). Each replica's leader (`replica_loop`) steps without pause (`--pace N`: N steps a second) and
records every step: when it began and ended, the members its sum names, whether its output matches the model in
one process, and every error. The cluster is first narrowed to 2 (`rayfree scale --dp 2`: replica 2 drains, its
node exits 0); then, measured, 2 -> 3 (`rayfree scale --dp 3` and node 2 started again with the same command)
and 3 -> 2. Printed per coupling:

- the time from the request to the new width serving: out, to node 0's `serving` for replica 2 (its node's
  start-up is in it; the cluster's cold start beside it) and, coupled, to the first step over every replica;
  in, to replica 2 drained and, coupled, to the first step over [0, 1];
- replicas 0 and 1: their failed calls (goal 0), steps run again (`ReplicasChanged`, coupled), wrong outputs, and
  their p99 step time and longest pause between two steps in the window before the changes and in each change.

    python bench/elastic.py [--couplings independent,coupled] [--window 3] [--pace 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Here, not in the entry: an import of torch in the entry runs with the heartbeats live (bench/coupled.py).
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import NodeRuns, echo_node_env, entry_result, has_netns, pct, secret, write_json  # noqa: E402

DP = 3
#: a replica that saw the stop file says so in its step's sum across replicas: coupled ones stop after one step
_STOP = 10**7


def say(tag: str, **kw) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def replica_loop(ex) -> int:
    """A replica leader's entry: checked steps until the bench makes the file ELASTIC_STOP, or its replica is
    drained (its figures are written then)."""
    from rayfree import ExecutorFailed, ReplicaDrained, ReplicasChanged
    from rayfree.cli.toy_engine import make_batch, reference_forward

    stop, end = os.environ["ELASTIC_STOP"], time.monotonic() + 900
    pace = float(os.environ.get("ELASTIC_PACE", "0"))
    coupled = ex.parallel_config.coupled
    states: list[list] = []  # [time, replica, state]
    ex.register_replica_callback(lambda k, st: states.append([time.monotonic(), k, st.state]))
    steps: list[list] = []  # [begin, end, members, output right]
    changed: list[float] = []
    failed: list[list] = []  # [time, error]
    step, total, outcome = 0, 0, "stopped"
    say("STEPPING", replica=ex.dp_rank, epoch=ex.parallel_config.replica_epoch, t=time.monotonic())
    while time.monotonic() < end and total < _STOP:
        t = time.monotonic()
        if pace and steps:
            time.sleep(max(0.0, steps[-1][0] + 1.0 / pace - t))
            t = time.monotonic()
        batch = make_batch(step, replica=ex.dp_rank)
        x = batch["x"]
        seen_stop = os.path.exists(stop)
        x[0, 0] += 10.0**ex.dp_rank + (_STOP if seen_stop else 0) - x.sum()
        try:
            out = ex.execute_model(batch)
            total = int(round(ex.collective_rpc("step_report", unique_reply_rank=0, timeout=60)["dp_sum"]))
        except ReplicasChanged:
            changed.append(time.monotonic())
            continue
        except ReplicaDrained:
            outcome = "drained"
            break
        except ExecutorFailed as e:
            failed.append([time.monotonic(), f"{type(e).__name__}: {e}"[:300]])
            outcome = "failed"
            break
        members = [k for k in range(7) if total // 10**k % 10 == 1] if coupled else [ex.dp_rank]
        steps.append([t, time.monotonic(), members, bool(torch.equal(out, reference_forward(x)))])
        step += 1
        if not coupled and seen_stop:
            break
    with open(f"{stop}.{ex.dp_rank}.{os.getpid()}.json", "w") as f:  # (too long for a pipe the workers log to)
        json.dump({"replica": ex.dp_rank, "epoch": ex.parallel_config.replica_epoch, "steps": steps,
                   "changed": changed, "failed": failed, "states": states, "outcome": outcome}, f)  # fmt: skip
    say("RESULT", replica=ex.dp_rank, pid=os.getpid())
    return 0


def node_env(sim, k: int, coupling: str, stop: str, pace: float) -> dict[str, str]:
    """Node k's options, as every node of the bench is started (and as `rayfree scale` reads them)."""
    return echo_node_env(
        sim, k, RAYFREE_TENSOR_PARALLEL_SIZE="1", RAYFREE_DATA_PARALLEL_SIZE=str(DP), RAYFREE_REPLICA_COUPLING=coupling,
        RAYFREE_WORKER="rayfree.cli.toy_engine:ToyWorker", RAYFREE_WORKER_KWARGS="{}", ELASTIC_STOP=stop,
        ELASTIC_PACE=str(pace), RAYFREE_ENTRY="bench.elastic:replica_loop",
    )  # fmt: skip


def scale(sim, env: dict[str, str], width: int) -> tuple[float, str]:
    """`rayfree scale --dp width` on node 0 with the nodes' options, as an operator runs it: when it was asked,
    and its answer."""
    t = time.monotonic()
    p = sim.nodes[0].popen([sys.executable, "-m", "rayfree.cli", "scale", "--dp", str(width)], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out, _ = p.communicate(timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"rayfree scale --dp {width} failed ({p.returncode}): {out}")
    return t, out.strip()


def run(coupling: str, window: float, pace: float) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    stop = os.path.join(os.path.dirname(secret()), f"stop-elastic-{coupling}")
    with SimulatedCluster(DP) as sim:
        nodes = NodeRuns(sim)

        def launch(k: int) -> None:
            nodes.launch(k, node_env(sim, k, coupling, stop, pace))

        t_start = time.monotonic()
        for k in range(DP):
            launch(k)
        cold = nodes.stepping(list(range(DP)), t_start)
        scale(sim, node_env(sim, 0, coupling, stop, pace), 2)  # (the starting point: two replicas serve)
        code = nodes.popen[2].wait(120)
        first = entry_result(nodes, 2, stop)
        time.sleep(window + 0.5)  # (a bench, not a test: the window before the changes)
        t_out, said_out = scale(sim, node_env(sim, 0, coupling, stop, pace), 3)
        t_launch = time.monotonic()
        launch(2)
        if not nodes.waiting(2, "STEPPING", lambda m: True, 300):
            raise RuntimeError("replica 2 did not come back:\n" + nodes.told([0, 1, 2]))
        time.sleep(window + 0.5)
        t_in, said_in = scale(sim, node_env(sim, 0, coupling, stop, pace), 2)
        code2 = nodes.popen[2].wait(120)
        second = entry_result(nodes, 2, stop)
        time.sleep(window + 0.5)
        with open(stop, "w"):
            pass
        results = {k: entry_result(nodes, k, stop) for k in (0, 1)}
        nodes.reap()
        os.unlink(stop)
    return {"coupling": coupling, "cold_s": cold, "t_out": t_out, "t_launch": t_launch, "t_in": t_in,
            "said": [said_out, said_in], "window": window, "pace": pace, "results": results,
            "replica2": [first, second], "codes": [code, code2]}  # fmt: skip


def _span(steps: list[list], lo: float, hi: float) -> tuple[float, float, int]:
    """The p99 step time (ms), the longest time between two steps' ends (ms) and the steps, in [lo, hi)."""
    inside = [s for s in steps if lo <= s[0] < hi]
    ends = [s[1] for s in steps if lo <= s[1] < hi]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return pct([s[1] - s[0] for s in inside], 0.99) * 1e3, (max(gaps) * 1e3 if gaps else float("nan")), len(inside)


def figures(r: dict) -> dict:
    """What the report prints, also written with --json."""
    t_out, t_in, w = r["t_out"], r["t_in"], r["window"]
    node0 = r["results"][0] or {"states": [], "steps": []}
    serving = next((t for t, k, st in node0["states"] if k == 2 and st == "serving" and t > t_out), None)
    drained = next((t for t, k, st in node0["states"] if k == 2 and st == "drained" and t > t_in), None)
    out: dict = {"out_serving_s": serving - t_out if serving else None,
                 "out_node_s": serving - r["t_launch"] if serving else None,
                 "in_drained_s": drained - t_in if drained else None, "replicas": {}}  # fmt: skip
    for k in (0, 1):
        x = r["results"][k]
        if x is None:
            out["replicas"][k] = None
            continue
        steps = x["steps"]
        three = next((s[1] for s in steps if s[0] > t_out and s[2] == [0, 1, 2]), None)
        two = next((s[1] for s in steps if s[0] > t_in and s[2] == [0, 1]), None)
        out["replicas"][k] = {
            "steps": len(steps), "failed": len(x["failed"]), "again": len(x["changed"]),
            "wrong": sum(not s[3] for s in steps), "errors": [f[1] for f in x["failed"]],
            "before": _span(steps, t_out - w, t_out), "out": _span(steps, t_out, t_out + w),
            "in": _span(steps, t_in, t_in + w),
            "out_across_s": three - t_out if three else None, "in_across_s": two - t_in if two else None,
        }  # fmt: skip
    return out


def report(r: dict) -> dict:
    f = figures(r)
    pace = f"{r['pace']:.0f} steps/s a replica" if r["pace"] else "steps without pause"
    coupled = r["coupling"] == "coupled"
    print(f"\n{r['coupling']}: DP=3 x TP=1 on 3 nodes, scaled 2 -> 3 -> 2; cold start {r['cold_s']:.2f} s; {pace}")
    print(f"  rayfree scale: {r['said'][0]!r}; then {r['said'][1]!r}; node 2 exited {r['codes']}")

    def s(x: float | None) -> str:
        return f"{x:.2f} s" if x is not None else "never"

    print(f"  2 -> 3: replica 2 serving {s(f['out_serving_s'])} after the request, {s(f['out_node_s'])} after its "
          f"node was started (the cluster's cold start: {r['cold_s']:.2f} s)")  # fmt: skip
    print(f"  3 -> 2: replica 2 drained {s(f['in_drained_s'])} after the request")
    head = f"  {'replica':<9}{'failed':>7}{'again':>7}{'wrong':>7}{'steps':>7}"
    head += f"{'p99 ms before':>15}{'2->3':>8}{'3->2':>8}{'pause ms before':>17}{'2->3':>8}{'3->2':>8}"
    if coupled:
        head += f"{'across 3 s':>12}{'across 2 s':>12}"
    print(head)
    for k, x in f["replicas"].items():
        if x is None:
            print(f"  {k:<9}no result")
            continue
        line = f"  {k:<9}{x['failed']:>7}{x['again']:>7}{x['wrong']:>7}{x['steps']:>7}"
        line += f"{x['before'][0]:>15.2f}{x['out'][0]:>8.2f}{x['in'][0]:>8.2f}"
        line += f"{x['before'][1]:>17.1f}{x['out'][1]:>8.1f}{x['in'][1]:>8.1f}"
        if coupled:
            line += f"{s(x['out_across_s']):>12}{s(x['in_across_s']):>12}"
        print(line)
        for e in x["errors"]:
            print(f"    replica {k} failed: {e}")
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--couplings", default="independent,coupled")
    ap.add_argument("--window", type=float, default=3.0, help="seconds of steps before and after each change")
    ap.add_argument("--pace", type=float, default=0.0, help="steps per second a replica (0: without pause)")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if not has_netns("elastic.py"):
        return 2
    out = []
    for coupling in a.couplings.split(","):
        r = run(coupling, a.window, a.pace)
        out.append({**r, "figures": report(r)})
    write_json(a.json, out)
    bad = [x for r in out for x in r["figures"]["replicas"].values() if x is None or x["failed"] or x["wrong"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
