"""Failover on simulated nodes: what a lost node costs the DP replicas that did not lose it.

DP=D replicas of TP=T over D x T simulated nodes (one rank each; network namespaces, a /dev/shm each; root),
started as `rayfree node` starts them, with the lightest worker that still runs the real executor, queues,
gloo worlds and heartbeats (examples/echo_worker.py, distributed=True). Every replica's leader (this file's
`replica_loop`) sends a 1 KiB `echo` to its ranks without pause (`--pace N`: N times a second, as an engine
that waits for requests, which leaves this machine's two cores to a replacement as a real cluster's own nodes
would) and records each call. Mid-run a follower node of replica 1 is SIGKILLed (`--lose node-0`: node 0,
replica 0's leader; with TP=1 every replica runs on one node, and the others need nothing of node 0; with TP>1,
`--watch 8` has each replica's nodes watch each other, so that they outlive node 0 too). Printed per coupling
(`independent`, `one-world`):

- replica 1 (it lost a node): how long after the kill its pending call ended, and with what error;
- every other replica: its calls that failed (independent: none expected), its calls per second and p99 call
  latency in the 5 s before the kill and in the 5 s after it (the floor is the same replica before the loss),
  and, from sequence numbers, its calls answered wrong, lost by a rank, or run twice by one (none expected);
- the cluster's cold start (every node started until every leader calls), which is what a cluster in one
  world pays again after a loss; independent, the lost replica's nodes (node 0 and the nodes of its replica,
  which leave with it, with `--lose node-0`) are then started again with the same command, and the time until
  the rejoined replica's leader calls is put beside that cold start (the others call on meanwhile: their failed
  calls count the whole run).

    python bench/failover.py [--dp 3] [--tp 2] [--couplings independent,one-world] [--seconds 8] [--pace 0]
                             [--lose follower|node-0] [--watch 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import NodeRuns, echo_node_env, entry_result, has_netns, pct, secret, write_json  # noqa: E402

WINDOW_S = 5.0


def say(tag: str, **kw) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def replica_loop(ex) -> int:
    """A replica leader's entry: calls until the bench makes the file FAILOVER_STOP, or its replica fails. Each
    call carries its sequence number, every rank's reply is checked against it, and each rank counts the calls it
    ran, so a call answered wrong, lost or run twice shows (`wrong`, `lost`, `twice`)."""
    from rayfree import ExecutorFailed

    stop, end = os.environ["FAILOVER_STOP"], time.monotonic() + 600
    pace = float(os.environ.get("FAILOVER_PACE", "0"))  # calls per second (0: without pause)

    def count(worker) -> None:  # (in every rank: a closure, so it goes by value)
        ran, echo = worker.__dict__.setdefault("ran", []), worker.echo
        worker.echo = lambda x: (ran.append(int.from_bytes(x[:8], "big")), echo(x))[1]

    def counted(worker) -> list:
        return worker.__dict__.get("ran", [])

    t0s: list[float] = []
    dts: list[float] = []
    failed: list[float] = []
    kind, t_fail, wrong, seq = "", None, 0, 0
    ex.collective_rpc(count, timeout=120)
    ex.collective_rpc("echo", args=(b"\0" * 8,), timeout=120)
    say("STEPPING", replica=ex.dp_rank, t=time.monotonic())
    while time.monotonic() < end and not os.path.exists(stop):
        t = time.monotonic()
        if pace and t0s:
            time.sleep(max(0.0, t0s[-1] + 1.0 / pace - t))  # (the bench's pace: an engine that waits for requests)
            t = time.monotonic()
        seq += 1
        payload = seq.to_bytes(8, "big") + b"x" * 1016
        try:
            replies = ex.collective_rpc("echo", args=(payload,), timeout=30)
        except ExecutorFailed as e:
            kind, t_fail = type(e).__name__, time.monotonic()
            failed.append(t)
            break
        wrong += any(r != payload for r in replies)
        t0s.append(t)
        dts.append(time.monotonic() - t)
    ran = [] if kind else ex.collective_rpc(counted, timeout=60)  # (a lost replica's ranks are gone)
    want = list(range(seq + 1))  # (0: the first call)
    twice = sum(len(r) - len(set(r)) for r in ran)
    lost = sum(len(set(want) - set(r)) for r in ran)
    with open(f"{stop}.{ex.dp_rank}.{os.getpid()}.json", "w") as f:  # (too long for a pipe the workers log to)
        json.dump({"replica": ex.dp_rank, "t0s": t0s, "dts": dts, "failed": failed, "kind": kind, "t_fail": t_fail,
                   "wrong": wrong, "twice": twice, "lost": lost, "counted": bool(ran)}, f)  # fmt: skip
    say("RESULT", replica=ex.dp_rank, pid=os.getpid())
    return 0 if not kind else 1


def run(
    dp: int, tp: int, coupling: str, seconds: float, pace: float = 0.0, lose: str = "follower", watch: int = 0
) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    n = dp * tp
    victim = 0 if lose == "node-0" else tp + 1 if tp > 1 else tp  # replica 1's first follower (TP=1: its leader)
    lost = victim // tp
    stop = os.path.join(os.path.dirname(secret()), f"stop-{coupling}")
    with SimulatedCluster(n) as sim:
        nodes = NodeRuns(sim)

        def launch(k: int) -> None:
            env = echo_node_env(
                sim,
                k,
                RAYFREE_TENSOR_PARALLEL_SIZE=str(tp),
                RAYFREE_DATA_PARALLEL_SIZE=str(dp),
                RAYFREE_REPLICA_COUPLING=coupling,
                FAILOVER_STOP=stop,
                FAILOVER_PACE=str(pace),
                RAYFREE_WATCH_FANOUT=str(watch),
            )
            if k % tp == 0:
                env["RAYFREE_ENTRY"] = "bench.failover:replica_loop"
            nodes.launch(k, env)

        t_start = time.monotonic()
        for k in range(n):
            launch(k)
        leaders = list(range(0, n, tp))
        cold = nodes.stepping(leaders, t_start)
        time.sleep(WINDOW_S + 1.0)  # (a bench, not a test: the window before the loss)
        t_kill = time.monotonic()
        sim.nodes[victim].kill()
        time.sleep(seconds)  # (the window after the loss, and more)
        results, rejoin = {}, None
        if coupling == "independent" and lost == 1:  # replica 1's nodes, started again the same way, rejoin
            again = [k for k in range(n) if k // tp == 1]
            for k in again:
                nodes.popen[k].wait(60)  # (its survivors leave non-zero by themselves)
            if victim % tp:
                results[1] = entry_result(nodes, again[0], stop) or {
                    "replica": 1,
                    "missing": "".join(nodes.outs[again[0]]),
                }
            t_again = time.monotonic()
            for k in again:
                launch(k)
            rejoin = nodes.stepping([again[0]], t_again)
            time.sleep(1.0)
        elif coupling == "independent" and lost == 0 and (tp == 1 or watch > 0):  # node 0 again resumes the cluster
            for k in range(tp):  # (replica 0's other nodes leave with node 0, and are started again with it)
                nodes.popen[k].wait(60)
            t_again = time.monotonic()
            for k in reversed(range(tp)):
                launch(k)
            rejoin = nodes.stepping([0], t_again)
            time.sleep(1.0)
        with open(stop, "w"):
            pass
        for k in leaders:
            if k == victim and not (lost == 0 and rejoin is not None) or k // tp in results:
                continue
            r = entry_result(nodes, k, stop)
            results[k // tp] = r if r is not None else {"replica": k // tp, "missing": "".join(nodes.outs[k])[-2000:]}
        nodes.reap()
        os.unlink(stop)
    return {"coupling": coupling, "dp": dp, "tp": tp, "victim": victim, "lost": lost, "t_kill": t_kill, "cold_s": cold,
            "rejoin_s": rejoin, "results": results, "pace": pace, "watch": watch}  # fmt: skip


def report(r: dict) -> None:
    pace = f"{r['pace']:.0f} calls/s a replica" if r["pace"] else "calls without pause"
    watch = f"; the watch, fan-out {r['watch']}" if r.get("watch") else ""
    print(f"\n{r['coupling']}: DP={r['dp']} x TP={r['tp']} on {r['dp'] * r['tp']} nodes; node {r['victim']} "
          f"(replica {r['lost']}) SIGKILLed; cold start {r['cold_s']:.2f} s; {pace}{watch}")  # fmt: skip
    if r["rejoin_s"] is not None:
        print(f"  replica {r['lost']}'s nodes started again: it served again after {r['rejoin_s']:.2f} s "
              f"({r['rejoin_s'] / r['cold_s']:.2f}x the whole cluster's cold start)")  # fmt: skip
    t_kill = r["t_kill"]
    print(f"  {'replica':<9}{'outcome':<34}{'failed':>7}{'calls/s before':>16}{'after':>8}"
          f"{'p99 ms before':>15}{'after':>8}{'wrong':>7}{'lost':>6}{'twice':>7}")  # fmt: skip
    for k in sorted(r["results"]):
        x = r["results"][k]
        if "missing" in x:
            print(f"  {k:<9}no result: {x['missing'][-300:]!r}")
            continue
        before = [d for t, d in zip(x["t0s"], x["dts"]) if t_kill - WINDOW_S <= t < t_kill]
        after = [d for t, d in zip(x["t0s"], x["dts"]) if t_kill <= t < t_kill + WINDOW_S]
        out = f"{x['kind']} after {x['t_fail'] - t_kill:.2f} s" if x["kind"] else "served on"
        full = bool(x["t0s"]) and x["t0s"][-1] >= t_kill + WINDOW_S  # (a whole window after the kill)
        late = f"{len(after) / WINDOW_S:.0f}" if full else "-"
        p99 = f"{pct(after, 0.99) * 1e3:.2f}" if full else "-"
        checked = [str(x["wrong"]), *((str(x["lost"]), str(x["twice"])) if x["counted"] else ("-", "-"))]
        print(
            f"  {k:<9}{out:<34}{len(x['failed']):>7}{len(before) / WINDOW_S:>16.0f}{late:>8}"
            f"{pct(before, 0.99) * 1e3:>15.2f}{p99:>8}{checked[0]:>7}{checked[1]:>6}{checked[2]:>7}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--couplings", default="independent,one-world")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the replicas call after the kill")
    ap.add_argument("--pace", type=float, default=0.0, help="calls per second a replica (0: without pause)")
    ap.add_argument("--lose", choices=("follower", "node-0"), default="follower",
                    help="the node SIGKILLed: replica 1's first follower, or node 0 (replica 0's leader)")  # fmt: skip
    ap.add_argument("--watch", type=int, default=0,
                    help="RAYFREE_WATCH_FANOUT on every node (0: off; with it replicas over several nodes outlive "
                         "node 0)")  # fmt: skip
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if not has_netns("failover.py"):
        return 2
    out = []
    for coupling in a.couplings.split(","):
        r = run(a.dp, a.tp, coupling, a.seconds, a.pace, a.lose, a.watch)
        report(r)
        out.append(r)
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
