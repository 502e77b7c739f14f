"""The control plane simulated to 256 nodes: join, handle exchange, heartbeats, relay tree and detection.

Each simulated node runs what `rayfree node` runs for the control plane, from the same code: its rank's
registration at node 0's rendezvous (cluster/join.py `join`), its heartbeats (`HeartbeatServer` on node 0,
a `HeartbeatClient` on every other node), its end of the broadcast (executor/broadcast.py `NodeBroadcast`:
node 0's sealed queue, a relay on every node with child nodes) and its rank's reader of it
(cluster/relay_tree.py `attach_broadcast`, which also checks that every node broadcasts the same way).
What is made cheap, so that 256 nodes fit on two cores and 24 GiB:

- one rank per node, read by a thread of the node's process instead of a worker process;
- no gloo world: the one all-gather the ranks do over gloo (each node's offer of its handle) goes through
  the same store instead;
- many nodes per process: node 0 alone in a network namespace (its egress is its interface's counter), the
  others in `--procs` processes in a second namespace (all on one address, each node on its own ports), and
  the last node alone in a process of its own, for the kill.

Printed per node count: formation (every rank registered at the store; every follower beating; the
broadcast ready, every relay and reader connected), tiny broadcast latency by tree depth (send to
arrival at each node's reader, one clock), node 0's bytes out per broadcast, node 0's heartbeat thread
and whole process CPU while idle, false losses while both cores are kept busy, and the detection time of
the last node killed.

With `--watch 0,8`, each node count runs with node 0 watching every node's quick link (0, as before the watch)
and with the watch tree (cluster/watch.py, fan-out 8), one after the other.

    python bench/control_plane.py [--nodes 32,64,128,256] [--watch 0,8] [--procs 4] [--rounds 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simnodes import has_netns, pythonpath, secret, write_json  # noqa: E402

PORT, HB_PORT, FANOUT = 29500, 29501, 8
INTERVAL, TIMEOUT = 0.5, 3.0  # the heartbeats' defaults
#: the tiny broadcasts' pace, and the 1 MiB one whose bytes out of node 0 count its copies
PACE_S, LOAD_PACE_S, BIG = 0.02, 0.25, 1 << 20


def say(tag: str, **kw: Any) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def config(n: int, k: int, master: str) -> Any:
    from rayfree.cluster.config import ClusterConfig, ParallelConfig

    par = ParallelConfig(tensor_parallel_size=n, nnodes=n, node_rank=k, master_addr=master, master_port=PORT)
    return ClusterConfig(parallel=par, broadcast="relay", relay_fanout=FANOUT, ready_timeout_s=600.0)


class StoreGroup:
    """The one all-gather `attach_broadcast` needs, over the rendezvous store (the ranks use gloo)."""

    def __init__(self, store: Any, rank: int, n: int) -> None:
        self.store, self.rank, self.rank_in_group, self.n = store, rank, rank, n

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        import datetime

        self.store.set(f"sim/offer/{self.rank}", data)
        keys = [f"sim/offer/{r}" for r in range(self.n)]
        self.store.wait(keys, datetime.timedelta(seconds=600))
        return [bytes(v) for v in self.store.multi_get(keys)]


def ready_then_go() -> float:
    """This process has imported what it needs: say so, and wait for the bench's go (every process is up), so
    that formation is timed from one instant and not from the processes' own start-up. Returns that instant."""
    import torch.distributed  # noqa: F401 - (the store's client)

    import rayfree.executor.broadcast  # noqa: F401

    go = os.environ["SIM_GO"]
    say("UP", pid=os.getpid())
    while not os.path.exists(go):
        time.sleep(0.01)
    with open(go) as f:
        return float(f.read() or 0)


def depth_of(k: int) -> int:
    from rayfree.transport.relay.tree import parent

    d = 0
    while k:
        k, d = parent(k, FANOUT), d + 1
    return d


def _thread_cpu(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def attach(cfg: Any, store: Any, nb: Any) -> Any:
    """This node's rank's reader (not ready yet), and its relay told where to subscribe."""
    from rayfree.cluster.relay_tree import attach_broadcast

    par = cfg.parallel
    mq, upstream = attach_broadcast(StoreGroup(store, par.node_rank, par.nnodes), cfg, 0, nb.worker_handle())
    nb.worker_ready(upstream)
    return mq


# -- node 0 --------------------------------------------------------------------------------------------------


def node0(n: int, master: str, rounds: int, load_s: float) -> int:
    from rayfree.cluster.heartbeat import Bye, HeartbeatServer
    from rayfree.cluster.join import join
    from rayfree.executor.broadcast import NodeBroadcast

    t0 = ready_then_go()
    lost: list[tuple[int, float, str]] = []
    server = HeartbeatServer(master, HB_PORT, {k: [k] for k in range(1, n)}, INTERVAL, TIMEOUT,
                             lambda node, _r, _ip, why: lost.append((node, time.monotonic(), why)))  # fmt: skip
    server.start()
    store = join(master, PORT, n, 0, 600.0, shape="sim", node=0)
    t_join = time.monotonic()
    while any(age is None for _n, _ip, _r, age, _g, _s in server.peer_views()):
        time.sleep(0.05)
    t_beat = time.monotonic()
    cfg = config(n, 0, master)
    nb = NodeBroadcast(cfg, lambda e: say("BROKEN", why=str(e)))
    mq = attach(cfg, store, nb)
    got: list[float] = []
    reader = threading.Thread(target=read_all, args=(mq, got), daemon=True)
    reader.start()
    queue = nb.queue
    queue.wait_until_ready(600.0)
    t_ready = time.monotonic()
    server.arm()  # (as a node does: once its ranks are ready, which is once every node's broadcast end is)
    say("FORMED", join=t_join - t0, beating=t_beat - t0, ready=t_ready - t0)
    idle_s = 10.0
    hb = server._thread.thread.native_id  # (the heartbeat thread's own CPU, from the kernel)
    c0, p0, w0, x0 = _thread_cpu(hb), time.process_time(), time.monotonic(), _tx_bytes()
    time.sleep(idle_s)
    c1, p1, w1, x1 = _thread_cpu(hb), time.process_time(), time.monotonic(), _tx_bytes()
    idle_tx = (x1 - x0) / (w1 - w0)  # (the heartbeats' answers: bytes out of node 0 per second)
    for i in range(rounds):
        queue.enqueue(("tiny", i, time.monotonic()))
        time.sleep(PACE_S)  # (paced: a latency, not a throughput)
    time.sleep(1.0)
    w2, x2 = time.monotonic(), _tx_bytes()
    queue.enqueue(("big", 0, time.monotonic(), b"\0" * BIG))
    time.sleep(1.0)  # (its bytes have left: the tree passes it on)
    big_tx = _tx_bytes() - x2 - idle_tx * (time.monotonic() - w2)
    say("LOAD", seconds=load_s)  # the bench keeps both cores busy meanwhile
    end = time.monotonic() + load_s
    i = rounds
    while time.monotonic() < end:  # (a broadcast now and then: the load is the two busy cores, not the sim's)
        queue.enqueue(("tiny", i, time.monotonic()))
        i += 1
        time.sleep(LOAD_PACE_S)
    victim, before = n - 1, len(lost)
    already = any(k == victim for k, _t, _w in lost[:before])  # (counted lost under the load: nothing to time)
    say("KILL", at=time.monotonic())
    until = time.monotonic() + (0 if already else 30)
    while not any(k == victim for k, _t, _w in lost[before:]) and time.monotonic() < until:
        time.sleep(0.01)
    # (a loss of another node, also one after the kill, is a false one: only the node killed is detected)
    killed = [t for k, t, _w in lost[before:] if k == victim]
    detected = killed[0] if killed and not already else None
    false_losses = len([k for k, _t, _w in lost if k != victim or detected is None])
    say("RESULT", lost=[(k, t - t0, why[:120]) for k, t, why in lost[:5]], n=n, idle_tx=idle_tx, big_tx=big_tx,
        big=BIG, idle_s=w1 - w0,
        hb_cpu=(c1 - c0) / (w1 - w0), proc_cpu=(p1 - p0) / (w1 - w0), false_losses=false_losses,
        lost_node=victim if detected else None, detected_at=detected,
        own=got[:rounds])  # fmt: skip
    queue.close()
    server.stop(Bye(0, True, "the bench is done"))
    server.join(10.0)
    return 0


def read_all(mq: Any, got: list[float]) -> None:
    """A rank: every broadcast's latency (send to here) until the writer closes."""
    from rayfree.transport.errors import QueueShutdown

    mq.wait_until_ready(600.0)
    while True:
        try:
            msg = mq.dequeue(timeout=600.0)
        except QueueShutdown:  # the writer closed
            return
        except Exception:  # noqa: BLE001 - node 0 is gone: what came is what there is
            return
        if msg[0] == "tiny":
            got.append(time.monotonic() - msg[2])


# -- the other nodes ------------------------------------------------------------------------------------------


def host(n: int, nodes: list[int], master: str, ip: str, rounds: int) -> int:
    """Nodes `nodes` in this process: each joins, beats, attaches its broadcast end and reads."""
    from rayfree.cluster.heartbeat_client import HeartbeatClient
    from rayfree.cluster.join import join
    from rayfree.cluster.watch import watchers
    from rayfree.executor.broadcast import NodeBroadcast

    ready_then_go()
    tree = watchers(config(n, 0, master).parallel)
    bye = threading.Event()
    lat: dict[int, list[float]] = {}
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            beat = HeartbeatClient(master, HB_PORT, k, [k], ip, INTERVAL, TIMEOUT,
                                   lambda why: bye.is_set() or errors.append(f"node {k}: {why}"),
                                   lambda _n, _clean, _why: bye.set(), "", tree[k],
                                   [c for c, w in tree.items() if w == k])  # fmt: skip
            beat.start()
            store = join(master, PORT, n, k, 600.0, shape="sim", node=k)
            cfg = config(n, k, master)
            nb = NodeBroadcast(cfg, lambda e: errors.append(f"node {k}: {e}"))
            mq = attach(cfg, store, nb)
            beat.arm()
            lat[k] = []
            read_all(mq, lat[k])
            nb.close()
            beat.stop(None)
        except Exception as e:  # noqa: BLE001 - said (node 0 waits for this node in vain), and in the result
            errors.append(f"node {k}: {type(e).__name__}: {e}")
            say("ERROR", node=k, why=errors[-1][:500])

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    by_depth: dict[int, list[float]] = {}
    for k, xs in lat.items():
        by_depth.setdefault(depth_of(k), []).extend(xs[:rounds])
    say("HOST", nodes=[nodes[0], nodes[-1]], errors=errors[:5], by_depth=by_depth)
    return 0


# -- the bench ------------------------------------------------------------------------------------------------


def run(n: int, procs: int, rounds: int, load_s: float, fanout: int) -> dict:
    from rayfree.cluster.simulate import SimulatedCluster

    with SimulatedCluster(2, shm_size="8g") as sim:  # (each relay's ring is allocated whole: 96 MiB)
        master, ip = sim.nodes[0].ip, sim.nodes[1].ip
        go = os.path.join(os.path.dirname(secret()), f"go-{n}")
        env = {"PYTHONPATH": pythonpath(), "RAYFREE_SECRET_FILE": secret(), "RAYFREE_LOG_LEVEL": "WARNING",
               "TORCH_CPP_LOG_LEVEL": "ERROR", "SIM_GO": go, "SIM_MASTER": master,
               "SIM_IP": ip, "RAYFREE_WATCH_FANOUT": str(fanout)}  # fmt: skip
        me = [sys.executable, os.path.abspath(__file__), "--n", str(n), "--rounds", str(rounds)]
        outs: list[list[str]] = []
        popen: list[subprocess.Popen] = []

        def launch(k: int, argv: list[str], first: tuple[str, ...] = ()) -> None:
            p = sim.nodes[k].popen([*first, *me, *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
            sink: list[str] = []
            threading.Thread(target=lambda: sink.extend(iter(p.stdout.readline, "")), daemon=True).start()
            outs.append(sink)
            popen.append(p)

        launch(0, ["--role", "node0", "--load", str(load_s)], first=("nice", "-n", "-10"))  # (its own machine)
        rest = list(range(1, n - 1))
        for i in range(procs):
            part = rest[i::procs]
            if part:
                launch(1, ["--role", "host", "--members", ",".join(map(str, part))])
        launch(1, ["--role", "host", "--members", str(n - 1)])  # the one killed

        def said(tag: str, timeout: float) -> dict:
            until = time.monotonic() + timeout
            while time.monotonic() < until:
                for line in list(outs[0]):
                    if line.startswith(tag + ":"):
                        return json.loads(line[len(tag) + 1 :])
                if popen[0].poll() is not None:
                    break
                time.sleep(0.05)
            said_else = "".join(x for out in outs[1:] for x in out if x.startswith("ERROR:"))[-3000:]
            raise RuntimeError(f"node 0 never said {tag}:\n" + "".join(outs[0])[-3000:] + said_else)

        until = time.monotonic() + 600
        while sum(x.startswith("UP:") for out in outs for x in list(out)) < len(outs) and time.monotonic() < until:
            time.sleep(0.05)
        with open(go + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(go + ".tmp", go)  # (whole, at once)
        formed = said("FORMED", 900)
        said("LOAD", 300)
        spin = f"import time\nt = time.time() + {load_s}\nwhile time.time() < t: pass"
        busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
        said("KILL", load_s + 60)
        for b in busy:
            b.wait(30)
        t_kill = time.monotonic()
        os.killpg(popen[-1].pid, signal.SIGKILL)
        result = said("RESULT", 60)
        hosts = []
        for i, p in enumerate(popen[1:-1], 1):
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
            hosts += [json.loads(x[5:]) for x in outs[i] if x.startswith("HOST:")]
        popen[0].wait(60)
        os.unlink(go)
    by_depth: dict[int, list[float]] = {0: result["own"]}
    errors = []
    for h in hosts:
        errors += h["errors"]
        for d, xs in h["by_depth"].items():
            by_depth.setdefault(int(d), []).extend(xs)
    detection = result["detected_at"] - t_kill if result["detected_at"] else None
    return {"n": n, "fanout": fanout, "formed": formed, "result": {k: v for k, v in result.items() if k != "own"},
            "by_depth": {d: sorted(xs) for d, xs in sorted(by_depth.items())}, "detection": detection,
            "errors": errors, "hosts": len(hosts)}  # fmt: skip


def report(rows: list[dict]) -> None:
    print(f"\ncontrol plane, simulated nodes (1 rank each, relay fan-out {FANOUT}, sealed), heartbeats every "
          f"{INTERVAL} s")  # fmt: skip
    head = ("nodes", "watch", "join s", "beating s", "ready s", "hb out KB/s", "out/1MiB", "hb cpu%", "node0 cpu%",
            "false", "detect s")  # fmt: skip
    print("  " + " ".join(f"{h:>10}" for h in head) + "  tiny p50 ms by tree depth")
    for r in rows:
        f, x = r["formed"], r["result"]
        det = f"{r['detection']:.2f}" if r["detection"] is not None else "-"
        cells = (r["n"], r.get("fanout", 0), f"{f['join']:.1f}", f"{f['beating']:.1f}", f"{f['ready']:.1f}",
                 f"{x['idle_tx'] / 1e3:.1f}",
                 f"{x['big_tx'] / x['big']:.2f}", f"{x['hb_cpu'] * 100:.2f}", f"{x['proc_cpu'] * 100:.2f}",
                 x["false_losses"], det)  # fmt: skip
        depths = " ".join(f"{d}:{xs[len(xs) // 2] * 1e3:.2f}" for d, xs in r["by_depth"].items() if xs)
        print("  " + " ".join(f"{c:>10}" for c in cells) + "  " + depths)
        if r["errors"]:
            print(f"        errors: {r['errors'][:3]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="32,64,128,256")
    ap.add_argument("--procs", type=int, default=16, help="processes that host the nodes other than 0 and the last")
    ap.add_argument("--rounds", type=int, default=100, help="tiny broadcasts timed")
    ap.add_argument("--load", type=float, default=15.0, help="seconds both cores are kept busy (false losses)")
    ap.add_argument(
        "--watch",
        default="0,8",
        help="RAYFREE_WATCH_FANOUT per run, alternated at each node count (0: node 0 watches every node)",
    )
    ap.add_argument("--json")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--members", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "node0":
        return node0(a.n, os.environ["SIM_MASTER"], a.rounds, a.load)
    if a.role == "host":
        return host(a.n, [int(k) for k in a.members.split(",")], os.environ["SIM_MASTER"],
                    os.environ["SIM_IP"], a.rounds)  # fmt: skip
    if not has_netns("control_plane.py"):
        return 2
    rows = []
    for n in (int(x) for x in a.nodes.split(",")):
        for fanout in (int(x) for x in a.watch.split(",")):
            rows.append(run(n, a.procs, a.rounds, a.load, fanout))
            report(rows[-1:])
    report(rows)
    write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
