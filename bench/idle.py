"""What a formed cluster costs while it waits, and at 100 tiny calls a second, against the floor (root: two
simulated nodes), in rounds whose order flips.

- rayfree: two nodes x one rank (sealed, as in production), formed; idle, then 100 `collective_rpc`s a second of
  a tiny method: % of one core, summed over every process of both nodes (node processes and workers), from each
  thread's /proc schedstat (nanoseconds); and the busiest threads, by the names the supervisor gives them;
- floor, idle: a gloo pair (one process per node) that joined and sleeps;
- floor, paced: raw pyzmq, a DEALER on node 0 and a ROUTER echoing it on node 1, 100 round trips a second of the
  same tiny message.

`--watch 0,8` runs rayfree once per RAYFREE_WATCH_FANOUT given, in each round (unset: the default).

    python bench/idle.py [--rounds 3] [--seconds 20] [--watch 0,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rayfree.cluster.simulate import netns_missing  # noqa: E402 - (once the checkout is on the path)
from tests.support.paths import pythonpath  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from simnodes import process_tree  # noqa: E402

ENTRY = """
import sys, time

def entry(ex):
    ex.collective_rpc("check_health", timeout=60)
    print("IDLE", flush=True)
    sys.stdin.readline()  # the parent says when the idle window is over
    print("PACED", flush=True)
    n, t0 = 0, time.monotonic()
    while not _stop():
        ex.collective_rpc("check_health", timeout=60)
        n += 1
        time.sleep(max(0.0, t0 + n / 100 - time.monotonic()))
    print("DONE", n, flush=True)
    return 0

def _stop():
    import select
    return bool(select.select([sys.stdin], [], [], 0)[0])
"""

GLOO = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", world_size=2, rank=int(sys.argv[1]))
dist.barrier()
print("IDLE", flush=True)
sys.stdin.readline()
"""

ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
print("IDLE", flush=True)
while True:
    s.send_multipart(s.recv_multipart())
"""

PACE = """
import select, sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(sys.argv[1])
print("PACED", flush=True)
n, t0 = 0, time.monotonic()
while not select.select([sys.stdin], [], [], 0)[0]:
    s.send(b"x" * 64)
    s.recv()
    n += 1
    time.sleep(max(0.0, t0 + n / 100 - time.monotonic()))
"""


def _threads(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (process and thread name, nanoseconds on a CPU so far), for every thread of `pids`' trees."""
    out = {}
    for pid in process_tree(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1][:24]
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except (OSError, ValueError):
                continue
            out[(pid, int(tid))] = (f"{title}/{comm}", ns)
    return out


def _cost(pids: list[int], seconds: float) -> tuple[float, Counter]:
    """% of one core all of `pids`' threads used over `seconds` from now, and by thread name."""
    a = _threads(pids)
    t = time.monotonic()
    time.sleep(seconds)
    b = _threads(pids)
    wall = time.monotonic() - t
    by: Counter = Counter()
    for k, (name, ns) in b.items():
        by[name] += ns - a.get(k, (name, 0))[1]
    return sum(by.values()) / 1e9 / wall * 100, Counter({k: v / 1e9 / wall * 100 for k, v in by.items()})


def _expect(p: subprocess.Popen, word: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"process {p.args} ended before saying {word}")
        if line.startswith(word):
            return
    raise TimeoutError(word)


def _env(**more: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": pythonpath(),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "RAYFREE_LOG_LEVEL": "WARNING",
        **more,
    }


def rayfree(sim, entry_dir: str, seconds: float, watch: str) -> tuple[float, float, Counter, Counter]:
    from simnodes import pair_env

    procs = []
    for k in (1, 0):
        more = {"RAYFREE_WATCH_FANOUT": watch} if watch else {}
        env = pair_env(sim, k, "idle_entry:entry", entry_dir, _env(**more))
        procs.append(
            sim.nodes[k].popen(
                [sys.executable, "-m", "rayfree.cli", "node"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
    lead = procs[1]
    try:
        _expect(lead, "IDLE")
        time.sleep(1.0)  # (the first call's after-effects settle)
        idle, idle_by = _cost([p.pid for p in procs], seconds)
        lead.stdin.write("\n")
        lead.stdin.flush()
        _expect(lead, "PACED")
        time.sleep(1.0)
        paced, paced_by = _cost([p.pid for p in procs], seconds)
        lead.stdin.write("\n")
        lead.stdin.flush()
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return idle, paced, idle_by, paced_by


def gloo_pair(sim, seconds: float) -> float:
    procs = [
        sim.nodes[k].popen(
            [sys.executable, "-c", GLOO, str(k)],
            env=_env(MASTER_ADDR=sim.nodes[0].ip, MASTER_PORT="29400"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    try:
        for p in procs:
            _expect(p, "IDLE")
        time.sleep(1.0)
        cost, _ = _cost([p.pid for p in procs], seconds)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    return cost


def zmq_paced(sim, seconds: float) -> float:
    ep = f"tcp://{sim.nodes[1].ip}:29600"
    echo = sim.nodes[1].popen([sys.executable, "-c", ECHO, ep], env=_env(), stdout=subprocess.PIPE, text=True)
    pace = sim.nodes[0].popen(
        [sys.executable, "-c", PACE, ep], env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        _expect(echo, "IDLE")
        _expect(pace, "PACED")
        time.sleep(1.0)
        cost, _ = _cost([echo.pid, pace.pid], seconds)
    finally:
        for p in (pace, echo):
            p.kill()
            p.wait(10)
    return cost


def _watch(w: str) -> str:
    return f", watch {w}" if w else ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--watch", default="", help="RAYFREE_WATCH_FANOUT values, a rayfree row each (unset: default)")
    a = ap.parse_args()
    watches = [w.strip() for w in a.watch.split(",") if w.strip()] or [""]
    if any(not w.isdigit() for w in watches if w):
        print(f"bench/idle.py: --watch takes fan-outs such as 0,8, not {a.watch!r}")
        return 2
    if netns_missing():
        print(f"bench/idle.py: two simulated nodes need network namespaces; this machine lacks {netns_missing()}")
        return 0
    from rayfree.cluster.simulate import SimulatedCluster

    entry_dir = tempfile.mkdtemp(prefix="rayfree-idle-")
    with open(os.path.join(entry_dir, "idle_entry.py"), "w") as f:
        f.write(ENTRY)
    rows: dict[str, list[float]] = {"gloo": [], "zmq": []}
    for w in watches:
        rows[f"idle{w}"], rows[f"paced{w}"] = [], []
    threads_idle: Counter = Counter()
    threads_paced: Counter = Counter()
    print(
        f"an idle cluster and 100 calls/s, {a.rounds} round(s) of {a.seconds:.0f} s windows, order flipped each round"
    )
    try:
        with SimulatedCluster(2) as sim:
            for i in range(a.rounds):
                for which in ("rayfree", "floor") if i % 2 == 0 else ("floor", "rayfree"):
                    if which == "rayfree":
                        for w in watches if i % 2 == 0 else watches[::-1]:
                            idle, paced, by_i, by_p = rayfree(sim, entry_dir, a.seconds, w)
                            rows[f"idle{w}"].append(idle)
                            rows[f"paced{w}"].append(paced)
                            threads_idle.update({f"w{w} {k}": v for k, v in by_i.items()} if w else by_i)
                            threads_paced.update({f"w{w} {k}": v for k, v in by_p.items()} if w else by_p)
                    else:
                        rows["gloo"].append(gloo_pair(sim, a.seconds))
                        rows["zmq"].append(zmq_paced(sim, a.seconds))
                for w in watches:
                    print(
                        f"    round {i + 1}{_watch(w)}: idle {rows[f'idle{w}'][-1]:.2f}% (gloo pair "
                        f"{rows['gloo'][-1]:.2f}%), 100 calls/s {rows[f'paced{w}'][-1]:.2f}% (raw zmq "
                        f"{rows['zmq'][-1]:.2f}%)",
                        flush=True,
                    )
    finally:
        import shutil

        shutil.rmtree(entry_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    goal = max(0.6, 1.5 * med["gloo"])
    for w in watches:
        print(
            f"  idle, all processes{_watch(w)}: {med[f'idle{w}']:.2f}% of a core (gloo pair {med['gloo']:.2f}%; "
            f"goal <= {goal:.2f}%)"
        )
        print(f"  100 tiny calls/s{_watch(w)}: {med[f'paced{w}']:.2f}% (raw zmq {med['zmq']:.2f}%; goal <= 4%)")
    for title, by in (("idle", threads_idle), ("paced", threads_paced)):
        top = ", ".join(f"{k} {v / a.rounds:.2f}%" for k, v in by.most_common(6 * len(watches)))
        print(f"  busiest threads, {title}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
