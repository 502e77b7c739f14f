"""The caller's cost around a step: what a call costs beyond the worker's own compute, when the worker takes
0.1, 1, 5 or 30 ms to answer, and what the waiting side burns meanwhile.

bench/rpc.py times calls the worker answers at once; an engine's calls take milliseconds, and while the caller
waits its reader parks, so waking it costs every step. Here the worker computes for real (torch.mm into
tensors made before timing, one thread; no sleep), times its own compute and returns that time; the caller's
cost is the call's wall time minus it. Rigs, alternated in rounds (a slow spell hits each alike): rayfree's
transport queues (a broadcast queue and a reply queue, as the executor holds them; and both on the remote path,
ZeroMQ over TCP loopback, sealed as between nodes), `collective_rpc` at 1 and 4 workers and over two simulated
nodes (as root: node 0's entry is the caller there, and times itself), vLLM's MessageQueue both ways (as its
executor holds them; when vLLM imports, e.g. with its venv), and a blocking pipe, each up alone in turn (vLLM's
readers spin while they wait: beside another rig they would take its core). Beside each: the caller process's
CPU while steps run, as a share of one core (its waiting), and the caller's and the workers' for a second once
the steps stop (idle).

    python bench/step.py [--quick] [--rounds R] [--steps-ms 0.1,1,5,30]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rayfree.cluster.config import ClusterConfig, ParallelConfig  # noqa: E402
from rayfree.executor import MultiprocExecutor  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_transport", os.path.join(ROOT, "bench", "transport.py"))
bt = importlib.util.module_from_spec(_spec)
sys.modules["bench_transport"] = bt
_spec.loader.exec_module(bt)

STOP = bt.STOP

sys.path.insert(0, os.path.join(ROOT, "bench"))
from step_worker import Burner, StepWorker  # noqa: E402

# -- rayfree's transport queues ------------------------------------------------------


def step_answer():  # noqa: ANN201 - made in the reader's process
    """A reader's answer to a step: compute for the time asked; the seconds it took."""
    burner = Burner()
    return lambda msg: burner.burn(msg[0])


class QueueRig(bt.MQRig):
    """rayfree's queues as the executor holds them; `remote`: the reader on the remote path (ZeroMQ over TCP
    loopback, sealed as between nodes, the reply too), as for a worker on another node."""

    name = "rayfree queues"

    def __init__(self, n: int, remote: bool = False) -> None:
        super().__init__(0 if remote else n, n if remote else 0, answer=step_answer)
        if remote:
            self.name = "rayfree remote"

    def step(self, ms: float) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.bq.enqueue((ms,))
        took = self.rq.dequeue(timeout=60)
        return time.perf_counter() - t0, took


# -- vLLM's MessageQueue both ways --------------------------------------------------


def vllm_step_reader(handle, rank: int, conn) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmQueue

    burner = Burner()
    bq = VllmQueue.create_from_handle(handle, rank)
    rq = None
    if rank == 0:
        rq = VllmQueue(1, 1)
        conn.send_bytes(pickle.dumps(rq.export_handle()))
    ready = threading.Thread(target=rq.wait_until_ready, daemon=True) if rq is not None else None
    if ready is not None:
        ready.start()
    bq.wait_until_ready()
    if ready is not None:
        ready.join(60)
    conn.send_bytes(b"ready")
    while True:
        msg = bq.dequeue()
        if msg == STOP:
            break
        took = burner.burn(msg[0])
        if rq is not None:
            rq.enqueue(took)


class VllmRig(QueueRig):
    name = "vLLM MessageQueue"

    def __init__(self, n: int) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmQueue

        ctx = mp.get_context("spawn")
        self.bq = VllmQueue(n, n)
        h = self.bq.export_handle()
        self.procs, conns = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=vllm_step_reader, args=(h, r, b), daemon=True)
            p.start()
            self.procs.append(p)
            conns.append(a)
        ready = threading.Thread(target=self.bq.wait_until_ready, daemon=True)  # (collective with the readers)
        ready.start()
        if not conns[0].poll(120):
            raise RuntimeError("vLLM reader 0 did not start")
        self.rq = VllmQueue.create_from_handle(pickle.loads(conns[0].recv_bytes()), 0)
        self.rq.wait_until_ready()
        ready.join(60)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("a vLLM reader did not become ready")
            c.recv_bytes()

    def step(self, ms: float) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.bq.enqueue((ms,))
        took = self.rq.dequeue()
        return time.perf_counter() - t0, took

    def close(self) -> None:
        self.bq.enqueue(STOP)
        for p in self.procs:
            p.join(30)


# -- a blocking pipe -------------------------------------------------------------------


def pipe_step_reader(conn) -> None:
    burner = Burner()
    conn.send_bytes(b"ready")
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg == STOP:
            break
        conn.send_bytes(pickle.dumps(burner.burn(msg[0])))


class PipeRig:
    name = "blocking pipe"

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=pipe_step_reader, args=(child,), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the pipe's reader did not start")
        self.conn.recv_bytes()

    def step(self, ms: float) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.conn.send_bytes(pickle.dumps((ms,)))
        took = pickle.loads(self.conn.recv_bytes())
        return time.perf_counter() - t0, took

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def close(self) -> None:
        self.conn.send_bytes(pickle.dumps(STOP))
        self.proc.join(30)


# -- collective_rpc ----------------------------------------------------------------------


class ExecRig:
    def __init__(self, n: int) -> None:
        self.name = f"collective_rpc x{n}"
        self.ex = MultiprocExecutor(ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=n)), StepWorker)

    def step(self, ms: float) -> tuple[float, float]:
        t0 = time.perf_counter()
        took = self.ex.collective_rpc("step", args=(ms,), unique_reply_rank=0)
        return time.perf_counter() - t0, took

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.ex.workers]

    def close(self) -> None:
        self.ex.shutdown()


# -- collective_rpc over two simulated nodes --------------------------------------------------


class NodesRig:
    """`collective_rpc` to two simulated nodes, one rank each (sealed, as in production): node 0's entry
    (step_worker.entry) times every call and its own CPU and prints them, for it is the caller there."""

    name = "rpc 2 nodes"

    def __init__(self) -> None:
        from rayfree.cluster.simulate import SimulatedCluster

        self.sim = SimulatedCluster(2)
        self.sim.__enter__()
        self.procs: list = []

    def measure(self, plan: dict[float, tuple[int, int]]) -> dict[float, tuple[list[float], float]]:
        """Every step length of `plan` ({ms: (warm calls, timed calls)}): its costs and the caller's CPU share."""
        import json
        import subprocess

        from simnodes import pair_env

        base = {**os.environ, "RAYFREE_LOG_LEVEL": "WARNING", "TORCH_CPP_LOG_LEVEL": "ERROR",
                "RF_STEP_PLAN": json.dumps({str(ms): list(v) for ms, v in plan.items()})}  # fmt: skip
        for k in (1, 0):
            env = {**pair_env(self.sim, k, "step_worker:entry", os.path.join(ROOT, "bench"), base),
                   "RAYFREE_WORKER": "step_worker:StepWorker"}  # fmt: skip
            self.procs.append(
                self.sim.nodes[k].popen([sys.executable, "-m", "rayfree.cli", "node"], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )  # fmt: skip
        lead, got, said = self.procs[-1], {}, []
        end = time.monotonic() + 600
        while time.monotonic() < end:
            line = lead.stdout.readline()
            said.append(line)
            if not line:
                tail = "".join(said[-15:])
                raise RuntimeError(f"node 0 ended (rc {lead.wait(10)}) before its steps were measured:\n{tail}")
            if line.startswith("STEP "):
                one = json.loads(line[5:])
                got[one["ms"]] = (one["costs"], one["cpu"])
            elif line.startswith("IDLE"):
                return got
        raise TimeoutError("node 0's steps took more than 600 s")

    def pids(self) -> list[int]:
        from simnodes import process_tree

        return [p for p in process_tree([q.pid for q in self.procs]) if p != os.getpid()]

    def close(self) -> None:
        try:
            if self.procs and self.procs[-1].poll() is None:
                self.procs[-1].stdin.write("\n")
                self.procs[-1].stdin.flush()
            for p in self.procs:
                try:
                    p.wait(60)
                except Exception:  # noqa: BLE001 - it is stopped below
                    p.kill()
                    p.wait(10)
        finally:
            self.sim.__exit__(None, None, None)


# -- the run -----------------------------------------------------------------------------


def cpu_s() -> float:
    """The CPU time of every thread of this (the calling, waiting) process so far."""
    return bt.run_seconds(os.getpid())


def idle_share(pids: list[int], seconds: float) -> float:
    """The CPU of these processes and this one over `seconds` with no call made, as a share of one core."""
    pids = [os.getpid(), *pids]
    c0, t0 = sum(bt.run_seconds(p) for p in pids), time.perf_counter()
    time.sleep(seconds)
    return (sum(bt.run_seconds(p) for p in pids) - c0) / (time.perf_counter() - t0)


def _calls(ms: float, rounds: int, quick: bool) -> tuple[int, int]:
    """How many calls warm a rig at this step length (the waiting side learns the rhythm), and how many are timed."""
    calls = max(5 if quick else 40, int((60 if quick else 300) / max(ms, 1.0)) // rounds)
    return max(8, calls // 10), calls


def run(makers: dict[str, object], steps_ms: list[float], rounds: int, quick: bool) -> tuple[dict, dict, dict]:
    """Each round starts every rig in turn, alone (vLLM's readers spin while they wait: up beside another rig,
    they would take its core), measures every step length through it, and closes it. Its costs (wall - worker),
    its CPU share while steps run (the caller's process) and once they stopped (the caller's and the workers':
    what waiting for the next call costs), per round, and its name."""
    out: dict = {}
    idle: dict = {}
    names: dict = {}
    for _ in range(rounds):
        for key, make in makers.items():
            rig = make()
            names[key] = rig.name
            try:
                plan = {ms: _calls(ms, rounds, quick) for ms in steps_ms}
                if hasattr(rig, "measure"):  # (its caller is elsewhere: it times every step length itself)
                    for ms, (costs, share) in rig.measure(plan).items():
                        got = out.setdefault((key, ms), {"costs": [], "cpu": []})
                        got["costs"] += costs
                        got["cpu"].append(share)
                for ms in steps_ms if not hasattr(rig, "measure") else ():
                    warm, calls = plan[ms]
                    for _ in range(warm):
                        rig.step(ms)  # (warm: the waiting side learns the rhythm)
                    c0, t0, costs = cpu_s(), time.perf_counter(), []
                    for _ in range(calls):
                        wall, took = rig.step(ms)
                        costs.append(wall - took)
                    share = (cpu_s() - c0) / (time.perf_counter() - t0)
                    got = out.setdefault((key, ms), {"costs": [], "cpu": []})
                    got["costs"] += costs
                    got["cpu"].append(share)
                idle.setdefault(key, []).append(idle_share(rig.pids(), 0.3 if quick else 1.0))
            finally:
                rig.close()
    return out, idle, names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-ms", default="0.1,1,5,30")
    ap.add_argument("--workers", default="1,4", help="collective_rpc's worker counts")
    ap.add_argument(
        "--rigs",
        default="queues,remote,pipe,vllm,rpc,nodes",
        help="which rigs (rpc: collective_rpc; remote: the queues over TCP loopback; nodes: collective_rpc over "
        "two simulated nodes, as root)",
    )
    args = ap.parse_args()
    steps = [float(x) for x in args.steps_ms.split(",")]
    want = set(args.rigs.split(","))
    makers: dict[str, object] = {
        "queues": lambda: QueueRig(1),
        "remote": lambda: QueueRig(1, remote=True),
        "pipe": lambda: PipeRig(1),
    }
    makers = {k: v for k, v in makers.items() if k in want}
    if "vllm" in want and bt._has_vllm():
        makers["vllm"] = lambda: VllmRig(1)
    for n in (int(x) for x in args.workers.split(",")) if "rpc" in want else ():
        makers[f"rpc{n}"] = lambda n=n: ExecRig(n)
    if "nodes" in want:
        from simnodes import has_netns

        if has_netns("step.py"):
            makers["nodes"] = NodesRig
    print(
        f"step bench: {os.cpu_count()} cores, {args.rounds} round(s), each rig alone in turn; cost = the call's "
        f"wall time minus the worker's compute, us; cpu = the caller's process while steps run, % of a core; "
        f"idle = the caller's and the workers' for a second after the steps stop"
        + ("" if "vllm" in makers else " (vLLM is not importable here: run with its venv for its column)")
    )
    from rayfree.cli.demo import demo_secret

    with demo_secret():  # (the remote rig's TCP needs a cluster secret: a throwaway one)
        res, idle, names = run(makers, steps, args.rounds, args.quick)
    hdr = f"{'rig':>20} {'step ms':>8} {'cost p50':>9} {'cost p99':>9} {'cpu %':>6} {'idle %':>7}"
    print(hdr)
    print("-" * len(hdr))
    for ms in steps:
        for key in makers:
            got = res[(key, ms)]
            c = got["costs"]
            print(f"{names[key]:>20} {ms:>8g} {bt.pct(c, 0.5) * 1e6:>9.0f} {bt.pct(c, 0.99) * 1e6:>9.0f} "
                  f"{100 * bt.pct(got['cpu'], 0.5):>6.1f} {100 * bt.pct(idle[key], 0.5):>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
