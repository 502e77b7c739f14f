"""One rank (or an external writer) of the cluster tests, run inside a simulated node.

    python -m tests.support.cluster_rank SCENARIO RANK WORLD MASTER PORT

It prints one JSON line starting with RESULT: what it saw, for the test to check.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

N_MSGS = 500
N_FROM = 6
CHUNK = 1 << 16


def out(**kw) -> None:
    print("RESULT:" + json.dumps(kw), flush=True)


def path_of(mq) -> str:
    return "writer" if mq.is_writer else ("shm" if mq.is_local_reader else "tcp")


def groups(rank: int, world: int, master: str, port: int) -> None:
    from rayfree.cluster.parallel_state import (
        destroy_distributed_environment,
        get_world_group,
        init_distributed_environment,
    )
    from rayfree.transport import MessageQueue
    from tests.support.children import digest, mixed_messages

    g = init_distributed_environment(world, rank, f"tcp://{master}:{port}", timeout_s=60)
    same = g.same_node_as(0)
    bq = g.create_mq_broadcaster(writer_rank=0, max_chunk_bytes=CHUNK, max_chunks=8)
    q, handles = g.create_single_reader_mq_broadcasters(reader_rank_in_group=0)
    readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
    q.wait_until_ready(timeout=60)
    for r in readers:
        r.wait_until_ready(timeout=60)
    ready_at = time.time()
    msgs = mixed_messages(N_MSGS, CHUNK, seed=7)
    bad = 0
    if rank == 0:
        for m in msgs:
            bq.enqueue(m, timeout=60)
    else:
        want = [digest(m) for m in msgs]
        bad = sum(digest(bq.dequeue(timeout=60)) != w for w in want)
    for i in range(N_FROM):  # fewer than the queue's chunks: rank 0 reads only after sending its own
        q.enqueue(("from", rank, i), timeout=60)
    got_from: dict[int, int] = {}
    reader_paths = []
    if rank == 0:
        for src, r in enumerate(readers):
            ok = [r.dequeue(timeout=60) == ("from", src, i) for i in range(N_FROM)]
            got_from[src] = sum(ok)
            reader_paths.append(path_of(r))
    # round trip of a tiny message to the first remote rank and back
    remote = [i for i, s in enumerate(same) if not s] or [world - 1]
    probe = remote[0]
    rtts = []
    for i in range(300):
        t0 = time.perf_counter()
        if rank == 0:
            bq.enqueue(("ping", i))
            assert readers[probe].dequeue(timeout=30) == ("pong", i)
            rtts.append(time.perf_counter() - t0)
        else:
            m = bq.dequeue(timeout=30)
            if rank == probe:
                q.enqueue(("pong", m[1]))
    get_world_group().barrier()
    for r in readers:
        r.close()
    destroy_distributed_environment()
    out(
        rank=rank,
        ok=True,
        same=same,
        path=path_of(bq),
        bad=bad,
        got_from=got_from,
        reader_paths=reader_paths,
        n_handles=len(handles),
        ready_at=ready_at,
        rtt_p50_us=statistics.median(rtts) * 1e6 if rtts else None,
        probe=probe,
    )


def external_writer(world: int, n_local: int, ip: str) -> None:
    from rayfree.transport import MessageQueue
    from tests.support.children import mixed_messages

    mq = MessageQueue(world, n_local, list(range(n_local)), max_chunk_bytes=CHUNK, max_chunks=8, connect_ip=ip)
    print("HANDLE:" + mq.export_handle().to_bytes().hex(), flush=True)
    mq.wait_until_ready(timeout=60)
    for m in mixed_messages(N_MSGS, CHUNK, seed=11):
        mq.enqueue(m, timeout=60)
    mq.close()
    out(ok=True, writer=True)


def external(rank: int, world: int, master: str, port: int) -> None:
    from rayfree.cluster.parallel_state import destroy_distributed_environment, init_distributed_environment
    from tests.support.children import digest, mixed_messages

    g = init_distributed_environment(world, rank, f"tcp://{master}:{port}", timeout_s=60)
    handle = bytes.fromhex(os.environ["RF_HANDLE"]) if rank == 0 else None
    bq = g.create_mq_broadcaster(writer_rank=0, external_writer_handle=handle, blocking=True)
    want = [digest(m) for m in mixed_messages(N_MSGS, CHUNK, seed=11)]
    bad = sum(digest(bq.dequeue(timeout=60)) != w for w in want)
    g.barrier()
    destroy_distributed_environment()
    out(rank=rank, ok=True, path=path_of(bq), bad=bad)


def _comm(tid: str) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def layout(rank: int, world: int, master: str, port: int) -> None:
    """TP=2 x PP=2: every getter's group, and a gloo all-reduce over the TP group."""
    import torch
    import torch.distributed as dist

    from rayfree.cluster import parallel_state as ps
    from rayfree.cluster.config import ParallelConfig

    before = []
    for getter in (ps.get_world_group, ps.get_tp_group):
        try:
            getter()
        except ps.GroupError as e:
            before.append(str(e))
    ps.init_distributed_environment(world, rank, f"tcp://{master}:{port}", timeout_s=60)
    ps.initialize_model_parallel(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    groups = {
        name: getattr(ps, f"get_{name}_group")().ranks
        for name in ("world", "tp", "pp", "dp", "pcp", "dcp", "ep", "inner_dp_world")
    }
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=ps.get_tp_group().cpu_group)
    alone = torch.tensor([rank + 1.0])
    dist.all_reduce(alone, group=ps.get_dp_group().cpu_group)  # (a group of one: its own value)
    loops = sum(_comm(tid) == "gloo_tcp_loop" for tid in os.listdir("/proc/self/task"))
    tp = ps.get_tp_group()
    gathered = tp.all_gather_bytes(f"r{rank}".encode())
    ps.destroy_model_parallel()
    initialized_after = ps.model_parallel_is_initialized()
    ps.destroy_distributed_environment()
    out(
        rank=rank,
        ok=True,
        before=before,
        groups=groups,
        tp_sum=t.item(),
        dp_sum=alone.item(),
        gloo_loops=loops,
        rank_in_tp=tp.rank_in_group,
        gathered=[g.decode() for g in gathered],
        initialized_after=initialized_after,
    )


def missing(rank: int, world: int, master: str, port: int) -> None:
    from rayfree.cluster.parallel_state import JoinError, init_distributed_environment

    t0 = time.monotonic()
    try:
        init_distributed_environment(world, rank, f"tcp://{master}:{port}", timeout_s=float(os.environ["RF_JOIN_S"]))
    except JoinError as e:
        out(rank=rank, ok=False, error=str(e), after_s=time.monotonic() - t0)
        return
    out(rank=rank, ok=True)


def shape(rank: int, world: int, master: str, port: int) -> None:
    """A rank that believes in another shape (its node was started with other sizes)."""
    from rayfree.cluster.parallel_state import JoinError, init_distributed_environment

    t0 = time.monotonic()
    try:
        init_distributed_environment(
            world,
            rank,
            f"tcp://{master}:{port}",
            timeout_s=float(os.environ["RF_JOIN_S"]),
            shape=os.environ["RF_SHAPE"],
            node=int(os.environ["RF_NODE"]),
        )
    except JoinError as e:
        out(rank=rank, ok=False, error=str(e), after_s=time.monotonic() - t0)
        return
    out(rank=rank, ok=True)


def main() -> None:
    import faulthandler

    # A stuck rank shows where it is stuck, and exits before the test gives up on it.
    faulthandler.dump_traceback_later(float(os.environ.get("RF_STUCK_S", "100")), exit=True)
    scenario = sys.argv[1]
    try:
        if scenario == "writer":
            external_writer(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
            return
        rank, world, master, port = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        {"groups": groups, "external": external, "missing": missing, "layout": layout, "shape": shape}[scenario](
            rank, world, master, port
        )
    except BaseException:
        out(ok=False, crash=traceback.format_exc())
        sys.exit(1)


if __name__ == "__main__":
    main()
