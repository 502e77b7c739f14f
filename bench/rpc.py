"""Executor benchmark: collective_rpc round trips beside the bare transport, and start-up time.

Round trip: `collective_rpc("ack", args=(payload,), unique_reply_rank=0)`
through a MultiprocExecutor with N workers, beside bench/transport.py's
broadcast + one reply with the same N readers, in the same run. `ack` replies
b"ok", as the transport bench's reader does, so both rigs move the same bytes
and the difference is the executor's own work: the call envelope, the
worker's dispatch, the reply check. (Before timing, `nbytes` checks once that
each payload arrives whole.) Both rigs are
up at once and measured in alternating rounds (each round warmed up first),
so a slow spell of the machine hits both alike instead of whichever ran then,
and each rig's processes are pinned to the same cores as the other's (see
`pin`; `--no-pin` leaves placement to the scheduler). Start-up: a
MultiprocExecutor with the toy engine on 4 workers (TP=2 x PP=2: spawn,
torch, gloo world and groups, model, queues) beside starting 4 bare Python
processes that import torch, in the same run.

    python bench/rpc.py [--quick] [--rounds R] [--no-pin]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rayfree.cluster.config import ClusterConfig, ParallelConfig  # noqa: E402
from rayfree.executor import MultiprocExecutor  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_transport", os.path.join(ROOT, "bench", "transport.py"))
bt = importlib.util.module_from_spec(_spec)
sys.modules["bench_transport"] = bt
_spec.loader.exec_module(bt)


def cfg(tp: int, pp: int = 1) -> ClusterConfig:
    return ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))


class ExecRig:
    def __init__(self, n: int) -> None:
        self.ex = MultiprocExecutor(cfg(n), "examples.echo_worker:EchoWorker")

    def check(self, obj) -> None:
        got = self.ex.collective_rpc("nbytes", args=(obj,), unique_reply_rank=0)
        if got != bt.nbytes(obj) and not isinstance(obj, tuple):
            raise RuntimeError(f"the worker received {got} bytes of a {bt.nbytes(obj)}-byte payload")

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.ex.workers]

    def round_trip(self, obj) -> float:
        t0 = time.perf_counter()
        self.ex.collective_rpc("ack", args=(obj,), unique_reply_rank=0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ex.shutdown()


def interleaved(rigs: dict, loads: list, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each payload's iterations split into `rounds` rounds; within a round every rig takes its turn."""
    res: dict[str, dict[str, list[float]]] = {k: {} for k in rigs}
    for name, obj, iters in loads:
        per = max(5, iters // rounds)
        for _ in range(rounds):
            for key, rig in rigs.items():
                res[key].setdefault(name, []).extend(bt.measure(rig, obj, per))
    return res


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def pin(rigs: dict) -> tuple[str, dict[int, set[int]]] | None:
    """Give both rigs the same placement: the caller on the first core, rank i on core (i + 1) mod cores.

    Left to the scheduler, the placement of 1 + N spinning processes on fewer
    cores is luck that lasts: one rig's p50 sits at 30, 60 or 110 us for a
    whole run while the other's sits elsewhere, which swamps the few us being
    compared. Returns (layout, the caller's previous masks) or None where
    affinity cannot be set.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    me = os.getpid()
    before = {}
    for t in _threads(me):
        try:
            before[t] = os.sched_getaffinity(t)
        except OSError:  # the thread has ended
            pass
    _set(before, {cores[0]})
    for rig in rigs.values():
        for i, pid in enumerate(rig.pids()):
            _set(_threads(pid), {cores[(i + 1) % len(cores)]})
    n = len(next(iter(rigs.values())).pids())
    layout = f"caller on core {cores[0]}, " + ", ".join(
        f"rank {i} on core {cores[(i + 1) % len(cores)]}" for i in range(n)
    )
    return layout, before


def _set(threads, mask: set[int]) -> None:
    for t in threads:
        try:
            os.sched_setaffinity(t, mask)
        except OSError:  # the thread has ended
            pass


def unpin(before: dict[int, set[int]]) -> None:
    for t, mask in before.items():
        _set([t], mask)


def bare_start(n: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def executor_start() -> float:
    t0 = time.perf_counter()
    ex = MultiprocExecutor(cfg(2, 2), "rayfree.cli.toy_engine:ToyWorker")
    took = time.perf_counter() - t0
    ex.shutdown()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    ap.add_argument("--payloads", default="tiny,64KiB,4MiB,32MiB", help="comma-separated subset")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up comparison")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds per payload")
    ap.add_argument("--no-pin", action="store_true", help="leave the placement of processes to the scheduler")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    loads = [p for p in bt.payloads(args.quick) if p[0] in args.payloads.split(",")]
    print(f"rayfree executor bench: {os.cpu_count()} cores, torch {torch.__version__}")
    print()
    hdr = (
        f"{'workers':>7} {'payload':>8} {'transport p50 us':>17} {'executor p50 us':>16} {'executor p99 us':>16} "
        f"{'overhead':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    layouts = []
    for n in (int(x) for x in args.workers.split(",")):
        rigs = {"transport": bt.MQRig(n, 0)}
        pinned = None
        try:
            rigs["executor"] = ExecRig(n)
            for _, obj, _ in loads:
                rigs["executor"].check(obj)
            pinned = None if args.no_pin else pin(rigs)
            layouts.append(f"{n} worker(s): " + (pinned[0] if pinned else "placement left to the scheduler"))
            res = interleaved(rigs, loads, args.rounds)
        finally:
            if pinned:
                unpin(pinned[1])
            for rig in rigs.values():
                rig.close()
        for name, _, _ in loads:
            b, e = bt.pct(res["transport"][name], 0.5), bt.pct(res["executor"][name], 0.5)
            print(
                f"{n:>7} {name:>8} {b * 1e6:>17.1f} {e * 1e6:>16.1f} "
                f"{bt.pct(res['executor'][name], 0.99) * 1e6:>16.1f} {(e / b - 1) * 100:>8.0f}%",
                flush=True,
            )
    print()
    print("placement, the same for both rigs:", *layouts, sep="\n  ")
    print()
    if args.no_startup:
        return
    reps = 2 if args.quick else 3
    bare = statistics.median(bare_start(4) for _ in range(reps))
    ex = statistics.median(executor_start() for _ in range(reps))
    print(
        f"start-up, 4 workers (toy engine, TP=2 x PP=2, gloo world + groups + queues): {ex:.2f} s; "
        f"4 bare processes importing torch: {bare:.2f} s; ratio {ex / bare:.2f}"
    )


if __name__ == "__main__":
    from rayfree.cli.demo import demo_secret

    with demo_secret():  # the remote paths are TCP, which needs a cluster secret (a throwaway one here)
        main()
