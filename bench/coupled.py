"""Coupled DP replicas on simulated nodes: what a lost replica and its rejoin cost the groups across replicas.

DP=D replicas of TP=1 over D simulated nodes (root: network namespaces), started as `rayfree node` starts them
with `replica_coupling="coupled"` and the toy model, whose every step all-reduces across replicas. Each
replica's leader (`replica_loop`) steps without pause and records, per step, when it ended and which replicas
its all-reduce summed (each replica's batch sums to 10**k; the bench's stop is in the sum too, so all stop
after the same step). Mid-run the last replica's node is SIGKILLed and
then started again with the same command. Printed:

- shrink: from the kill to the survivors' first correct step over the remaining replicas (goal <= 2 s);
- grow: from node 0 saying the rejoined replica serves to the first correct step over every replica, and
  from the replacement's start, beside the cluster's cold start;
- every step's output checked against the model in one process, and the members of every step.

    python bench/coupled.py [--dp 3] [--seconds 6] [--timeout 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Here, not in the entry: `rayfree node` imports the entry's module before the cluster forms, while an import in
# the entry runs with the heartbeats live, and torch's (its libraries load holding the GIL) stalls them for
# seconds on a starved machine: the nodes then lose each other (docs/operations.md, "Entry points").
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import NodeRuns, echo_node_env, has_netns, secret, write_json  # noqa: E402


def say(tag: str, **kw) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


#: a replica that saw the stop file says so in its step's sum across replicas: every replica stops after it
_STOP = 10**7


def replica_loop(ex) -> int:
    """A replica leader's entry: checked steps until the bench makes the file COUPLED_STOP."""
    from rayfree import ReplicasChanged
    from rayfree.cli.toy_engine import make_batch, reference_forward

    stop, end = os.environ["COUPLED_STOP"], time.monotonic() + 600
    serving: list[float] = []
    ex.register_replica_callback(lambda k, st: st.state == "serving" and serving.append(time.monotonic()))
    steps: list[list] = []  # [end time, members, output right]
    changed: list[float] = []
    step = 0
    say("STEPPING", replica=ex.dp_rank, t=time.monotonic())
    total = 0
    while time.monotonic() < end and total < _STOP:  # (every replica stops after the same step: in step)
        batch = make_batch(step, replica=ex.dp_rank)
        x = batch["x"]
        x[0, 0] += 10.0**ex.dp_rank + (_STOP if os.path.exists(stop) else 0) - x.sum()
        try:
            out = ex.execute_model(batch)
            total = int(round(ex.collective_rpc("step_report", unique_reply_rank=0, timeout=60)["dp_sum"]))
        except ReplicasChanged:
            changed.append(time.monotonic())
            continue
        members = [k for k in range(7) if total // 10**k % 10 == 1]
        if not steps or steps[-1][1] != members:
            say("MEMBERS", replica=ex.dp_rank, members=members)  # (the bench waits for the rejoined one's)
        steps.append([time.monotonic(), members, bool(torch.equal(out, reference_forward(x)))])
        step += 1
    with open(f"{stop}.{ex.dp_rank}.{os.getpid()}.json", "w") as f:
        json.dump({"replica": ex.dp_rank, "steps": steps, "changed": changed, "serving": serving}, f)
    say("RESULT", replica=ex.dp_rank, pid=os.getpid())
    return 0


def run(dp: int, seconds: float, timeout: float) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    victim = dp - 1
    stop = os.path.join(os.path.dirname(secret()), "stop-coupled")
    with SimulatedCluster(dp) as sim:
        nodes = NodeRuns(sim)

        def launch(k: int) -> None:
            nodes.launch(k, echo_node_env(
                sim, k, RAYFREE_TENSOR_PARALLEL_SIZE="1", RAYFREE_DATA_PARALLEL_SIZE=str(dp),
                RAYFREE_REPLICA_COUPLING="coupled", RAYFREE_WORKER="rayfree.cli.toy_engine:ToyWorker",
                RAYFREE_WORKER_KWARGS="{}", RAYFREE_ACROSS_REPLICAS_TIMEOUT_S=str(timeout), COUPLED_STOP=stop,
                RAYFREE_ENTRY="bench.coupled:replica_loop",
            ))  # fmt: skip

        t_start = time.monotonic()
        for k in range(dp):
            launch(k)
        cold = nodes.stepping(list(range(dp)), t_start)
        time.sleep(3.0)  # (a bench, not a test: steps across every replica first)
        t_kill = time.monotonic()
        sim.nodes[victim].kill()
        time.sleep(seconds)  # (the survivors step over fewer replicas)
        nodes.popen[victim].wait(30)
        t_again = time.monotonic()
        launch(victim)
        grown = nodes.waiting(victim, "MEMBERS", lambda m: m["members"] == list(range(dp)), 150)
        if grown:
            time.sleep(seconds)  # (every replica steps over all of them)
        with open(stop, "w"):
            pass
        results = {}
        for k in range(dp):
            until = time.monotonic() + 60
            while (r := nodes.said(k, "RESULT")) is None and time.monotonic() < until:
                time.sleep(0.05)
            if r is None:
                print(f"node {k} gave no result:\n" + "".join(nodes.outs[k])[-6000:])
                continue
            path = f"{stop}.{r['replica']}.{r['pid']}.json"
            with open(path) as f:
                results[k] = json.load(f)
            os.unlink(path)
        nodes.reap()
        os.unlink(stop)
    return {"dp": dp, "cold_s": cold, "t_kill": t_kill, "t_again": t_again, "results": results}


def report(r: dict) -> None:
    dp, t_kill, t_again = r["dp"], r["t_kill"], r["t_again"]
    every, fewer = list(range(dp)), list(range(dp - 1))
    print(f"\ncoupled: DP={dp} x TP=1 on {dp} nodes; node {dp - 1} SIGKILLed, then started again; cold start "
          f"{r['cold_s']:.2f} s")  # fmt: skip
    print(f"  {'replica':<9}{'steps':>7}{'wrong':>7}{'changed':>9}{'shrink s':>10}{'grow s (serving)':>18}"
          f"{'grow s (start)':>16}")  # fmt: skip
    for k in sorted(r["results"]):
        x = r["results"][k]
        steps = x["steps"]
        wrong = sum(not ok for _, _, ok in steps)
        shrunk = next((t for t, m, _ in steps if t > t_kill and m == fewer), None)
        grown = next((t for t, m, _ in steps if t > t_again and m == every), None)
        back = next((t for t in x["serving"] if t > t_again), None)
        shrink = f"{shrunk - t_kill:.2f}" if shrunk and k != dp - 1 else "-"
        grow1 = f"{grown - back:.2f}" if grown and back else "-"
        grow2 = f"{grown - t_again:.2f}" if grown else "-"
        print(f"  {k:<9}{len(steps):>7}{wrong:>7}{len(x['changed']):>9}{shrink:>10}{grow1:>18}{grow2:>16}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="how long the survivors step before the rejoin")
    ap.add_argument("--timeout", type=float, default=5.0, help="RAYFREE_ACROSS_REPLICAS_TIMEOUT_S")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if not has_netns("coupled.py"):
        return 2
    r = run(a.dp, a.seconds, a.timeout)
    report(r)
    write_json(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
