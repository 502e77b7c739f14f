"""`rayfree demo` on its default: the toy engine on two simulated nodes of this machine.

Each node is a network namespace with its own IP and its own /dev/shm (as
root; otherwise loopback with every rank forced remote). Node 0 runs
`rayfree node` with the demo driver as its entry point, node 1 runs it
headless: the same invocation as docker-compose.yml, through environment
variables. Afterwards it checks that nothing is left: no process, no
segment in either node's /dev/shm, no namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from rayfree import settings
from rayfree.cluster.config import ParallelConfig
from rayfree.cluster.simulate import SimulatedCluster
from rayfree.procs import cmdline, group_members
from rayfree.transport.net import get_open_port
from rayfree.transport.shm.segment import SHM_DIR, creator_alive, entries

WORKER = "rayfree.cli.toy_engine:ToyWorker"
ENTRY = "rayfree.cli.demo_driver:drive"


def node_command() -> list[str]:
    """`rayfree node`, run by this interpreter (the console script may not be on PATH)."""
    return [sys.executable, "-m", "rayfree.cli", "node"]


def node_env(
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    tp: int,
    pp: int,
    worker: str = WORKER,
    entry: str | None = ENTRY,
    dp: int = 1,
    **extra: str,
) -> dict[str, str]:
    """The environment that makes `rayfree node` node `node_rank` (as the compose file sets it)."""
    env = {
        "RAYFREE_NNODES": str(nnodes),
        "RAYFREE_NODE_RANK": str(node_rank),
        "RAYFREE_MASTER_ADDR": master_addr,
        "RAYFREE_MASTER_PORT": str(master_port),
        "RAYFREE_TENSOR_PARALLEL_SIZE": str(tp),
        "RAYFREE_PIPELINE_PARALLEL_SIZE": str(pp),
        "RAYFREE_DATA_PARALLEL_SIZE": str(dp),
        "RAYFREE_WORKER": worker,
    }
    if ParallelConfig(data_parallel_size=dp, nnodes=nnodes).leads(node_rank):  # the first node of a DP replica
        env["RAYFREE_ENTRY"] = entry or ENTRY
    else:
        env["RAYFREE_HEADLESS"] = "1"
    env.update(extra)
    return env


def _leftovers(sim: SimulatedCluster, since: float) -> list[str]:
    """Segments in the nodes' /dev/shm, and processes still running in the nodes' process groups."""
    found = []
    for n in sim.nodes:
        for path in sorted(entries((n.shm_dir or SHM_DIR,))):
            # A private /dev/shm holds only this demo's; the shared one, only what a dead process made since.
            if n.shm_dir or (os.stat(path).st_mtime >= since and not creator_alive(path)):
                found.append(path)
        for p in n.procs:
            left = _group_members(p.pid)
            if left:
                found.append(f"processes {left} of node {n.index}")
    return found


def _group_members(pgid: int, wait_s: float = 5.0) -> list[str]:
    """Processes still in a node's process group, after giving stragglers (multiprocessing's resource
    tracker exits when its parent has) `wait_s` to finish."""
    deadline = time.monotonic() + wait_s
    while True:
        members = [f"{pid} {cmdline(pid)}" for pid in group_members(pgid)]
        if not members or time.monotonic() >= deadline:
            return members
        time.sleep(0.1)


def _lose_replica_1(par: ParallelConfig, sim: SimulatedCluster, procs: list, launch, marks: str, deadline: float):
    """Once every leader steps: SIGKILL replica 1's last node, wait for its other nodes to leave (non-zero, as a
    lost replica's nodes do), and start them all again with the same command: they rejoin. Their exit codes.
    A replica 1 that was lost before that (its nodes left on their own) is started again the same way, as its
    launcher would; a node of another replica that leaves ends the demo."""
    ours = par.nodes_of_replica(1)
    while len(os.listdir(marks)) < par.data_parallel_size:
        if time.monotonic() > deadline or any(p.poll() is not None for k, p in enumerate(procs) if k not in ours):
            return {}
        if any(procs[k].poll() is not None for k in ours):
            print("  DP replica 1 was lost before the demo took a node of it away (see the nodes' log)", flush=True)
            break
        time.sleep(0.05)
    else:
        victim = ours[-1]
        print(
            f"  losing DP replica 1: SIGKILL to node {victim} (of its nodes {ours}) while all replicas step", flush=True
        )
        sim.nodes[victim].kill()
    try:
        codes = {k: procs[k].wait(max(1.0, deadline - time.monotonic())) for k in ours}
    except subprocess.TimeoutExpired:
        return {}
    print(f"  replica 1's nodes left ({codes}); starting nodes {ours} again with the same command ...", flush=True)
    for k in ours:
        procs[k] = launch(k)
    return codes


def run_cluster_demo(
    nnodes: int, tp: int, pp: int, steps: int, dp: int = 1, timeout_s: float | None = None, lose_replica: bool = False
) -> int:
    from rayfree.cluster.config import ConfigError

    if steps < 1 or nnodes < 2:
        print("rayfree demo: --steps must be >= 1 and --nodes >= 2 here", file=sys.stderr)
        return 2
    if lose_replica and dp < 2:
        print("rayfree demo: --lose-replica needs --dp 2 or more (replica 1 is lost, others serve)", file=sys.stderr)
        return 2
    try:
        par = ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, nnodes=nnodes
        ).validate()
    except ConfigError as e:
        print(f"rayfree demo: {e}", file=sys.stderr)
        return 2
    world = par.world_size_across_dp
    timeout_s = timeout_s if timeout_s is not None else settings.get("RAYFREE_DEMO_TIMEOUT_S")
    t0 = time.time()
    shape = f"DP={dp} x TP={tp} x PP={pp}" if dp > 1 else f"TP={tp} x PP={pp}"
    print(
        f"rayfree demo: toy engine, {shape} = {world} workers on {nnodes} simulated nodes "
        f"({world // nnodes} each), {steps} steps"
    )
    if dp > 1:
        for r in range(dp):
            print(f"  DP replica {r}: node(s) {par.nodes_of_replica(r)} (leader: node {par.nodes_of_replica(r)[0]})")
    from .demo import demo_secret

    with demo_secret() as secret, SimulatedCluster(nnodes) as sim:
        how = (
            "own network namespace, IP and /dev/shm each"
            if sim.mode == "netns"
            else "loopback, shared /dev/shm, ranks forced remote (not root)"
        )
        print(f"  nodes: {', '.join(f'node {n.index} = {n.ip}' for n in sim.nodes)} ({how})")
        print(
            f"  security: queues sealed with AES-256-GCM, heartbeats over CURVE, signed handles (cluster secret "
            f"{secret})"
        )
        print("  starting `rayfree node` on each node (spawn, torch, gloo world, model, queues) ...", flush=True)
        master = sim.nodes[0].ip
        port = 29500 if sim.mode == "netns" else get_open_port("127.0.0.1")
        extra = {
            "RAYFREE_SECRET_FILE": secret,
            "RAYFREE_DEMO_STEPS": str(steps),
            "RAYFREE_DEMO_T0": repr(t0),
            "RAYFREE_DEMO_TIMEOUT_S": repr(timeout_s),
            "RAYFREE_LOG_LEVEL": os.environ.get("RAYFREE_LOG_LEVEL", "WARNING"),
            # torch warns that a namespace has no reverse DNS for its peers: true, and harmless here
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        }
        if sim.mode != "netns":
            extra["RAYFREE_HEARTBEAT_PORT"] = str(get_open_port("127.0.0.1"))
        marks = tempfile.mkdtemp(prefix="rayfree-demo-") if lose_replica else ""
        if marks:
            extra["RAYFREE_DEMO_MARKS"] = marks
        procs = []

        def launch(k: int) -> subprocess.Popen:
            return sim.nodes[k].popen(node_command(), env=node_env(nnodes, k, master, port, tp, pp, dp=dp, **extra))

        # Followers first: start order does not matter, and this shows it.
        for k in reversed(range(nnodes)):
            procs.insert(0, launch(k))
        codes: list[int | None] = []
        deadline = time.monotonic() + timeout_s
        lost_codes = _lose_replica_1(par, sim, procs, launch, marks, deadline) if marks else {}
        try:
            for p in procs:  # the leader first: when it ends, the followers end
                codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            print(f"rayfree demo: the nodes did not finish within {timeout_s:.0f} s; stopping them", file=sys.stderr)
            codes = [p.poll() for p in procs]
        left = _leftovers(sim, t0)
        if marks:
            shutil.rmtree(marks, ignore_errors=True)
    listed = (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if sim.mode == "netns" else ""
    )
    ns_left = sim.tag in listed
    print()
    if lose_replica:
        print(f"  {'lost incarnation exit codes':<34}{' '.join(f'{k}:{c}' for k, c in lost_codes.items()):>10}")
    print(f"  {'node exit codes':<34}{' '.join(str(c) for c in codes):>10}")
    print(f"  {'wall time (s)':<34}{time.time() - t0:>10.1f}")
    ok = all(c == 0 for c in codes) and not left and not ns_left
    if ok:
        print(
            "  all outputs match the single-process model; every node stopped cleanly; no process, shm segment "
            "or namespace left behind"
        )
    else:
        print(f"  FAILED: exit codes {codes}; leftovers {left}{' and namespaces' if ns_left else ''}")
    return 0 if ok else 1
