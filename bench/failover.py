"""Failover on simulated nodes: what a lost node costs the DP replicas that did not lose it.

DP=D replicas of TP=T over D x T simulated nodes (one rank each; network namespaces, a /dev/shm each; root),
started as `rayfree node` starts them, with the lightest worker that still runs the real executor, queues,
gloo worlds and heartbeats (examples/echo_worker.py, distributed=True). Every replica's leader (this file's
`replica_loop`) sends a 1 KiB `echo` to its ranks in a loop and records each call. Mid-run a follower node of
replica 1 is SIGKILLed. Printed per coupling (`independent`, `coupled`):

- replica 1 (it lost a node): how long after the kill its pending call ended, and with what error;
- every other replica: its calls that failed (independent: none expected), its calls per second and p99 call
  latency in the 5 s before the kill and in the 5 s after it (the floor is the same replica before the loss);
- the cluster's cold start (every node started until every leader calls), which is what a coupled cluster pays
  again after a loss; independent, replica 1's nodes are then started again with the same command, and the
  time until the rejoined replica's leader calls is put beside that cold start.

    python bench/failover.py [--dp 3] [--tp 2] [--couplings independent,coupled] [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import echo_node_env, secret  # noqa: E402

WINDOW_S = 5.0


def say(tag: str, **kw) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def replica_loop(ex) -> int:
    """A replica leader's entry: calls until the bench makes the file FAILOVER_STOP, or its replica fails."""
    from rayfree import ExecutorFailed

    stop, end = os.environ["FAILOVER_STOP"], time.monotonic() + 600
    payload = b"x" * 1024
    t0s: list[float] = []
    dts: list[float] = []
    failed: list[float] = []
    kind, t_fail = "", None
    ex.collective_rpc("echo", args=(payload,), timeout=120)
    say("STEPPING", replica=ex.dp_rank, t=time.monotonic())
    while time.monotonic() < end and not os.path.exists(stop):
        t = time.monotonic()
        try:
            ex.collective_rpc("echo", args=(payload,), timeout=30)
        except ExecutorFailed as e:
            kind, t_fail = type(e).__name__, time.monotonic()
            failed.append(t)
            break
        t0s.append(t)
        dts.append(time.monotonic() - t)
    with open(f"{stop}.{ex.dp_rank}.{os.getpid()}.json", "w") as f:  # (too long for a pipe the workers log to)
        json.dump({"replica": ex.dp_rank, "t0s": t0s, "dts": dts, "failed": failed, "kind": kind, "t_fail": t_fail}, f)
    say("RESULT", replica=ex.dp_rank, pid=os.getpid())
    return 0 if not kind else 1


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _json_after(lines: list[str], tag: str, lock: threading.Lock) -> dict | None:
    with lock:
        for line in lines:
            if line.startswith(tag + ":"):
                return json.loads(line[len(tag) + 1 :])
    return None


def run(dp: int, tp: int, coupling: str, seconds: float) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    n = dp * tp
    victim = tp + 1 if tp > 1 else tp  # replica 1's first follower (its leader when TP=1)
    stop = os.path.join(os.path.dirname(secret()), f"stop-{coupling}")
    lock = threading.Lock()
    with SimulatedCluster(n) as sim:

        def launch(k: int) -> tuple[subprocess.Popen, list[str]]:
            env = echo_node_env(
                sim,
                k,
                RAYFREE_TENSOR_PARALLEL_SIZE=str(tp),
                RAYFREE_DATA_PARALLEL_SIZE=str(dp),
                RAYFREE_REPLICA_COUPLING=coupling,
                FAILOVER_STOP=stop,
            )
            if k % tp == 0:
                env["RAYFREE_ENTRY"] = "bench.failover:replica_loop"
            p = sim.nodes[k].popen(
                [sys.executable, "-m", "rayfree.cli", "node"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            sink: list[str] = []

            def read() -> None:
                for line in p.stdout:  # type: ignore[union-attr]
                    with lock:
                        sink.append(line)

            threading.Thread(target=read, daemon=True).start()
            return p, sink

        def stepping(ks: list[int], since: float) -> float:
            """When the last of these nodes' entries made its first call (seconds after `since`)."""
            while not all(_json_after(outs[k], "STEPPING", lock) for k in ks):
                if any(popen[k].poll() is not None for k in ks) or time.monotonic() > since + 300:
                    raise RuntimeError("the nodes did not start:\n" + "".join(outs[ks[0]])[-4000:])
                time.sleep(0.05)
            return max(_json_after(outs[k], "STEPPING", lock)["t"] for k in ks) - since

        t_start = time.monotonic()
        started = [launch(k) for k in range(n)]
        popen, outs = [p for p, _ in started], [o for _, o in started]
        everyone = list(popen)
        leaders = list(range(0, n, tp))
        cold = stepping(leaders, t_start)
        time.sleep(WINDOW_S + 1.0)  # (a bench, not a test: the window before the loss)
        t_kill = time.monotonic()
        sim.nodes[victim].kill()
        time.sleep(seconds)  # (the window after the loss, and more)
        results, rejoin = {}, None
        if coupling == "independent":  # replica 1's nodes, started again with the same command, rejoin
            again = [k for k in range(n) if k // tp == 1]
            for k in again:
                popen[k].wait(60)  # (its survivors leave non-zero by themselves)
            if victim % tp:
                results[1] = _result(outs[again[0]], stop, lock) or {"replica": 1, "missing": "".join(outs[again[0]])}
            t_again = time.monotonic()
            for k in again:
                popen[k], outs[k] = launch(k)
                everyone.append(popen[k])
            rejoin = stepping([again[0]], t_again)
            time.sleep(1.0)
        with open(stop, "w"):
            pass
        for k in leaders:
            if k == victim or k // tp in results:
                continue
            r = _result(outs[k], stop, lock, popen[k])
            results[k // tp] = r if r is not None else {"replica": k // tp, "missing": "".join(outs[k])[-2000:]}
        for p in everyone:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        os.unlink(stop)
    return {"coupling": coupling, "dp": dp, "tp": tp, "victim": victim, "t_kill": t_kill, "cold_s": cold,
            "rejoin_s": rejoin, "results": results}  # fmt: skip


def _result(lines: list[str], stop: str, lock: threading.Lock, p: subprocess.Popen | None = None) -> dict | None:
    """A leader's RESULT: the figures its entry wrote to a file of its own."""
    until = time.monotonic() + 60
    while (r := _json_after(lines, "RESULT", lock)) is None and time.monotonic() < until:
        if p is not None and p.poll() is not None and _json_after(lines, "RESULT", lock) is None:
            return None
        time.sleep(0.05)
    if r is None:
        return None
    path = f"{stop}.{r['replica']}.{r['pid']}.json"
    with open(path) as f:
        out: dict = json.load(f)
    os.unlink(path)
    return out


def report(r: dict) -> None:
    print(f"\n{r['coupling']}: DP={r['dp']} x TP={r['tp']} on {r['dp'] * r['tp']} nodes; node {r['victim']} "
          f"(replica 1) SIGKILLed; cold start {r['cold_s']:.2f} s")  # fmt: skip
    if r["rejoin_s"] is not None:
        print(f"  replica 1's nodes started again: it served again after {r['rejoin_s']:.2f} s "
              f"({r['rejoin_s'] / r['cold_s']:.2f}x the whole cluster's cold start)")  # fmt: skip
    t_kill = r["t_kill"]
    print(f"  {'replica':<9}{'outcome':<34}{'failed':>7}{'calls/s before':>16}{'after':>8}"
          f"{'p99 ms before':>15}{'after':>8}")  # fmt: skip
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
        p99 = f"{_pct(after, 0.99) * 1e3:.2f}" if full else "-"
        print(
            f"  {k:<9}{out:<34}{len(x['failed']):>7}{len(before) / WINDOW_S:>16.0f}{late:>8}"
            f"{_pct(before, 0.99) * 1e3:>15.2f}{p99:>8}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--couplings", default="independent,coupled")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the replicas call after the kill")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    from rayfree.cluster.simulate import can_use_netns

    if not can_use_netns():
        print("bench/failover.py: needs root (network namespaces)")
        return 2
    out = []
    for coupling in a.couplings.split(","):
        r = run(a.dp, a.tp, coupling, a.seconds)
        report(r)
        out.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
