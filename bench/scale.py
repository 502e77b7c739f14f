"""Scale benchmark on simulated nodes: join time, broadcast latency, bytes out of node 0, heartbeat CPU.

Each configuration is N simulated nodes (network namespaces, a /dev/shm each; root) x R ranks per node,
started the way `rayfree node` starts them, with the lightest worker that still runs the real executor,
queues, gloo world and heartbeats (examples/echo_worker.py, distributed=True). Three broadcast paths:
flat (every remote rank subscribes to node 0), relay (one stream per node, into its ring) and tree
(relays with fan-out 2, so node 0 sends 2 copies whatever N). Node 0's entry point (this file's
`measure`) times `collective_rpc` to every rank for a tiny and a 1 MiB payload, counts the bytes node 0's
interface sent per 1 MiB broadcast, and the CPU its heartbeat thread used per follower over an idle spell.
The floor beside them, measured in the same run: a raw pyzmq PUB/SUB (+ PUSH back) round trip between two
namespaces, insecure (the cluster's own streams are sealed).

    python bench/scale.py [--nodes 2,4,8,16] [--ranks 1,2,4] [--modes flat,relay,tree] [--max-procs 40]
                          [--quick]

Configurations with more processes than --max-procs (node processes + workers) are skipped, with a line
saying so: on 2 cores and 24 GiB, each worker imports torch and joins gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import start_nodes  # noqa: E402

TREE_FANOUT = 2


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _thread_cpu(native_id: int) -> float:
    """Seconds on a CPU of one thread of this process (schedstat: nanoseconds, not 10 ms ticks)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(ex) -> int:
    """Node 0's entry point: the figures, as one RESULT line."""
    t_ready = time.monotonic()
    n_tiny = int(os.environ.get("RF_BENCH_TINY", "300"))
    n_big = int(os.environ.get("RF_BENCH_BIG", "40"))
    size = 1 << 20
    payload = os.urandom(size)
    for _ in range(20):
        ex.collective_rpc("ack", args=(b"x",))
    tiny = []
    for _ in range(n_tiny):
        t = time.perf_counter()
        ex.collective_rpc("ack", args=(b"x",))
        tiny.append(time.perf_counter() - t)
    for _ in range(3):
        ex.collective_rpc("nbytes", args=(payload,))
    big = []
    before = _tx_bytes()
    for _ in range(n_big):
        t = time.perf_counter()
        got = ex.collective_rpc("nbytes", args=(payload,))
        big.append(time.perf_counter() - t)
        assert got == [size] * ex.world_size, got
    copies = (_tx_bytes() - before) / n_big / size
    hb = [t for t in threading.enumerate() if t.name == "RayfreeHeartbeatServer"]
    cpu = None
    if hb and hb[0].native_id is not None:
        c0, w0 = _thread_cpu(hb[0].native_id), time.monotonic()
        threading.Event().wait(float(os.environ.get("RF_BENCH_IDLE_S", "3")))
        cpu = (_thread_cpu(hb[0].native_id) - c0) / (time.monotonic() - w0)
    nnodes = ex.parallel_config.nnodes
    print(
        "RESULT:"
        + json.dumps(
            {
                "t_ready": t_ready,
                "tiny_p50_us": _pct(tiny, 0.5) * 1e6,
                "tiny_p99_us": _pct(tiny, 0.99) * 1e6,
                "big_p50_ms": _pct(big, 0.5) * 1e3,
                "big_p99_ms": _pct(big, 0.99) * 1e3,
                "copies": copies,
                "hb_cpu_pct_per_node": None if cpu is None else 100 * cpu / max(1, nnodes - 1),
            }
        ),
        flush=True,
    )
    return 0


# -- the floor: raw pyzmq between two namespaces ------------------------------------------------------------


def _floor_role(role: str, peer: str) -> None:
    """`client` (node 0: PUB + PULL bound, times round trips) or `echo` (node 1: SUB -> PUSH)."""
    import zmq

    ctx = zmq.Context()
    if role == "echo":
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{peer}:29600")
        push.connect(f"tcp://{peer}:29601")
        while True:
            m = sub.recv(copy=False)
            push.send(b"ok" if len(m) > 16 else m)
            if bytes(m.buffer[:4]) == b"STOP":
                return
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind("tcp://*:29600")
    pull.bind("tcp://*:29601")
    pull.setsockopt(zmq.RCVTIMEO, 200)
    while True:  # until the echo is subscribed: a probe comes back
        pub.send(b"probe")
        try:
            pull.recv()
            break
        except zmq.Again:
            continue
    pull.setsockopt(zmq.RCVTIMEO, 10000)
    while pull.poll(100):
        pull.recv()

    def rtt(msg: bytes, n: int) -> list[float]:
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            pub.send(msg)
            pull.recv()
            xs.append(time.perf_counter() - t)
        return xs

    tiny, big = rtt(b"x", 300), rtt(os.urandom(1 << 20), 40)
    pub.send(b"STOP")
    pull.recv()  # the echo has it (and leaves)
    print("FLOOR:" + json.dumps({"tiny_p50_us": _pct(tiny, 0.5) * 1e6, "big_p50_ms": _pct(big, 0.5) * 1e3}))


def floor() -> dict[str, float]:
    from rayfree.cluster.simulate import SimulatedCluster

    me = os.path.abspath(__file__)
    with SimulatedCluster(2) as sim:
        echo = sim.nodes[1].popen([sys.executable, me, "--floor-role", "echo", sim.nodes[0].ip])
        client = sim.nodes[0].popen(
            [sys.executable, me, "--floor-role", "client", ""], stdout=subprocess.PIPE, text=True
        )
        try:
            out, _ = client.communicate(timeout=120)
            echo.wait(30)
        finally:
            sim.kill_all()
    return json.loads(out.split("FLOOR:", 1)[1])


# -- the driver ------------------------------------------------------------------------------------------


def run_config(n: int, ranks: int, mode: str, quick: bool) -> dict[str, Any]:
    from rayfree.cluster.simulate import SimulatedCluster

    with SimulatedCluster(n) as sim:
        t0 = time.monotonic()
        env = {
            "RAYFREE_BROADCAST": "flat" if mode == "flat" else "relay",
            "RAYFREE_RELAY_FANOUT": str(TREE_FANOUT if mode == "tree" else 8),
        }
        if quick:
            env.update(RF_BENCH_TINY="100", RF_BENCH_BIG="10", RF_BENCH_IDLE_S="1")
        procs, others = start_nodes(sim, ranks, os.path.abspath(__file__) + ":measure", **env)
        out: list[str] = []
        result = None
        try:
            assert procs[0].stdout is not None
            for line in procs[0].stdout:
                out.append(line)
                if line.startswith("RESULT:"):
                    result = json.loads(line[len("RESULT:") :])
            codes = [p.wait(120) for p in procs]
        finally:
            sim.kill_all()
        if result is None or any(codes):
            tail = "".join(out[-30:]) + "".join("".join(o[-10:]) for o in others)
            raise RuntimeError(f"{n} nodes x {ranks} ranks ({mode}) failed (exit codes {codes}):\n{tail}")
        result["join_s"] = result.pop("t_ready") - t0
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default="flat,relay,tree")
    ap.add_argument("--max-procs", type=int, default=40, help="skip configurations with more processes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--floor-role", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_role:
        _floor_role(*args.floor_role)
        return 0
    sys.path.insert(0, ROOT)
    from rayfree.cluster.simulate import can_use_netns, netns_missing

    if not can_use_netns():
        print(f"bench/scale.py: simulated nodes need network namespaces; this machine lacks {netns_missing()}",
              file=sys.stderr)  # fmt: skip
        return 2
    fl = floor()
    print(
        f"floor (raw pyzmq PUB/SUB + PUSH round trip between two namespaces, insecure): tiny p50 "
        f"{fl['tiny_p50_us']:.0f} us, 1 MiB p50 {fl['big_p50_ms']:.2f} ms",
        flush=True,
    )
    rows = []
    for ranks in [int(x) for x in args.ranks.split(",")]:
        for n in [int(x) for x in args.nodes.split(",")]:
            procs = n * (1 + ranks)
            if procs > args.max_procs:
                print(f"skip {n} nodes x {ranks} ranks: {procs} processes > --max-procs {args.max_procs}", flush=True)
                continue
            for mode in args.modes.split(","):
                if mode == "tree" and n - 1 <= TREE_FANOUT:
                    continue  # a star: the same as relay
                print(f"{n} nodes x {ranks} ranks, {mode} ...", flush=True)
                r = run_config(n, ranks, mode, args.quick)
                rows.append({"nodes": n, "ranks": ranks, "mode": mode, **r})
                print(
                    "  join {join_s:.1f}s  tiny p50/p99 {tiny_p50_us:.0f}/{tiny_p99_us:.0f}us  1MiB p50/p99 "
                    "{big_p50_ms:.2f}/{big_p99_ms:.2f}ms  node0 copies {copies:.2f}  hb cpu/node "
                    "{hb_cpu_pct_per_node:.3f}%".format(**r),
                    flush=True,
                )
    print()
    print(
        "| nodes x ranks | path | join s | tiny p50 / p99 us (x floor) | 1 MiB p50 / p99 ms (x floor) | "
        "copies out of node 0 | heartbeat CPU % per node |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['nodes']} x {r['ranks']} | {r['mode']} | {r['join_s']:.1f} | {r['tiny_p50_us']:.0f} / "
            f"{r['tiny_p99_us']:.0f} ({r['tiny_p50_us'] / fl['tiny_p50_us']:.1f}x) | {r['big_p50_ms']:.2f} / "
            f"{r['big_p99_ms']:.2f} ({r['big_p50_ms'] / fl['big_p50_ms']:.1f}x) | {r['copies']:.2f} | "
            f"{r['hb_cpu_pct_per_node']:.3f} |"
        )
    print()
    print("growth per added node (first to last node count of each path and rank count):")
    for ranks in sorted({r["ranks"] for r in rows}):
        for mode in args.modes.split(","):
            rs = sorted((r for r in rows if r["ranks"] == ranks and r["mode"] == mode), key=lambda r: r["nodes"])
            if len(rs) < 2:
                continue
            a, b = rs[0], rs[-1]
            dn = b["nodes"] - a["nodes"]
            print(
                f"  {mode} x{ranks}: join {(b['join_s'] - a['join_s']) / dn:+.2f} s/node, tiny p50 "
                f"{(b['tiny_p50_us'] - a['tiny_p50_us']) / dn:+.0f} us/node, 1 MiB p50 "
                f"{(b['big_p50_ms'] - a['big_p50_ms']) / dn:+.2f} ms/node, copies "
                f"{(b['copies'] - a['copies']) / dn:+.2f}/node ({a['nodes']}->{b['nodes']} nodes)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor": fl, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
