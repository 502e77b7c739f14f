"""The demo engine's driver: what `rayfree node --entry rayfree.cli.demo_driver:drive` runs on each DP replica's
leader (and `rayfree demo --nodes 1` in its own process).

torch is imported with this module, not inside `drive`: `rayfree node` loads an entry's module before it joins,
and an import inside the entry would load libtorch while this node's heartbeats are live, holding Python's lock
long enough, on a busy machine, for the other nodes to hear nothing and call this one lost (operations.md,
"Entry points").
"""

from __future__ import annotations

import os
import sys
import time

import torch

from rayfree import settings
from rayfree.cli.toy_engine import dp_sum, make_batch, reference_forward
from rayfree.cluster.join import coupling_of
from rayfree.worker.proc import worker_info

__all__ = ["drive"]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _topology(ex) -> list[dict]:
    return sorted(ex.collective_rpc(worker_info, timeout=60), key=lambda r: r["rank"])


def drive(ex, steps: int | None = None) -> int:
    """Topology, steps, latency table.

    Steps come from RAYFREE_DEMO_STEPS (default 200); RAYFREE_DEMO_T0 (a time.time()) makes it say how long
    the cluster took to become ready. With DP, each replica's leader runs it on its own batches, and every
    line says which replica it is about.
    """
    steps = steps if steps is not None else settings.get("RAYFREE_DEMO_STEPS")
    t0 = settings.get("RAYFREE_DEMO_T0")
    par = ex.parallel_config
    across = par.one_world or par.coupled  # (DP groups across the replicas: their all-reduce is checked)
    dp, replica = par.data_parallel_size, ex.dp_rank
    tag = f"[replica {replica}] " if dp > 1 else ""

    def say(text: str = "") -> None:
        print(f"  {tag}{text}" if text else "", flush=True)

    say(
        f"{par.world_size} workers on {par.nnodes_within_dp} node(s) ready"
        + (f" after {time.time() - float(t0):.1f} s" if t0 else "")
        + f"; output rank {ex.output_rank}"
    )
    # With DP: the replica, and each rank's place in the world all replicas share.
    lines = [
        (f"{'replica':<9}" if dp > 1 else "")
        + f"{'rank':<6}"
        + (f"{'world':<7}" if dp > 1 else "")
        + f"{'node':<6}{'ip':<16}{'process':<20}{'pid':>8}  {'broadcast':<10}{'replies':<8}"
    ]
    for r in _topology(ex):
        lines.append(
            (f"{r['replica']:<9}" if dp > 1 else "")
            + f"{r['rank']:<6}"
            + (f"{r['global_rank']:<7}" if dp > 1 else "")
            + f"{r['node']:<6}{r['ip']:<16}"
            f"{r['process']:<20}{r['pid']:>8}  {r['broadcast']:<10}{r['replies']:<8}"
        )
    for line in lines:
        say(line)
    lat: list[float] = []
    over: list[float] = []
    bad = bad_dp = 0
    tty = sys.stdout.isatty() and dp == 1  # replicas share the terminal: plain progress lines
    heard = _lose_and_rejoin(ex, say)
    t_run = time.perf_counter()
    # Replica 1 must serve again before the demo stops the nodes (its deadline, less time to say so).
    until = (float(t0) if t0 else time.time()) + settings.get("RAYFREE_DEMO_TIMEOUT_S") - 15
    step = 0
    while step < steps or (heard is not None and "serving" not in heard and time.time() < until):
        batch = make_batch(step, replica=replica)
        t = time.perf_counter()
        out = ex.execute_model(batch)
        dt = time.perf_counter() - t
        report = ex.collective_rpc("step_report", unique_reply_rank=ex.output_rank)
        lat.append(dt)
        over.append(max(0.0, dt - report["seconds"]))
        bad += not torch.equal(out, reference_forward(batch["x"]))
        bad_dp += across and report["dp_sum"] != dp_sum(step, dp)  # (independent replicas: no DP group)
        if tty:
            done = (step + 1) * 30 // steps
            print(f"\r  [{'#' * done}{'.' * (30 - done)}] step {step + 1}/{steps}", end="", flush=True)
        elif step < steps and ((step + 1) % 50 == 0 or step == steps - 1):
            say(f"step {step + 1}/{steps}")
        elif step >= steps and (step + 1) % 500 == 0:
            say(f"step {step + 1} (stepping on until DP replica 1 serves again)")
        step += 1
    steps = step
    if tty:
        print()
    run_s = time.perf_counter() - t_run
    rows = [
        ("steps", steps),
        ("steps per second", round(steps / run_s)),
        ("step latency p50 (us)", round(_pct(lat, 0.5) * 1e6)),
        ("step latency p99 (us)", round(_pct(lat, 0.99) * 1e6)),
        ("executor overhead p50 (us)", round(_pct(over, 0.5) * 1e6)),
        ("executor overhead p99 (us)", round(_pct(over, 0.99) * 1e6)),
        ("outputs equal to 1-process model", steps - bad),
    ]
    if dp > 1:
        rows.append(("replicas", coupling_of(par)))
    if across:
        rows.append(("cross-replica all-reduce correct", steps - bad_dp))
    for name, value in rows:
        say(f"{name:<34}{value:>10}")
    back = heard is None or "serving" in heard
    if not back:
        say("FAILED: DP replica 1 did not serve again before the demo's deadline (RAYFREE_DEMO_TIMEOUT_S)")
    return 0 if bad == 0 and bad_dp == 0 and back else 1


def _lose_and_rejoin(ex, say) -> list[str] | None:
    """`rayfree demo --lose-replica`: each leader marks that it steps (RAYFREE_DEMO_MARKS, for the demo to take
    a node of replica 1 away and start it again); replica 0 says what it hears of replica 1 and steps on until
    replica 1 serves again. None when not asked."""
    marks = settings.get("RAYFREE_DEMO_MARKS")
    if not marks:
        return None
    with open(os.path.join(marks, f"stepping-{ex.dp_rank}-{ex.parallel_config.replica_epoch}"), "w"):
        pass
    if ex.dp_rank != 0:
        return None
    heard: list[str] = []

    def changed(k: int, st) -> None:
        what = f"is {st.state} again (epoch {st.epoch})" if st.state == "serving" else f"was lost ({st.why})"
        say(f"DP replica {k} {what}; this replica serves on, with the same processes")
        heard.append(st.state)

    ex.register_replica_callback(changed)
    return heard
