"""`rayfree demo`: the toy engine under a MultiprocExecutor (and, with --transport, the bare transport).

Engine demo: 4 workers (TP=2 x PP=2) run rayfree/cli/toy_engine.py — by default
on two simulated nodes (cluster_demo.py), with --nodes 1 in this process;
every step's output is checked against the single-process model; the table
gives step latency and the executor's own overhead per step (latency minus
the time the output rank spent in execute_model, which includes the pipeline).

Transport demo: one writer (this process) broadcasts control messages and
tensors of 64 KiB to 32 MiB; local readers take them from the shared-memory
ring, remote ones over TCP on 127.0.0.1. Every reader checks each payload and
answers through its own one-reader queue, as workers answer the executor.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator

from rayfree.transport import MessageQueue
from rayfree.transport.secure import policy as security

STOP = "__stop__"


@contextlib.contextmanager
def demo_secret() -> Iterator[str]:
    """The configured cluster secret's file or, if there is none, a throwaway one for this demo run: this
    process's policy while it lasts; give the path to the node processes the demo starts."""
    from rayfree.transport.secure import policy as security

    existing = security.process_secret()
    if existing is not None:
        yield existing.source
        return
    d = tempfile.mkdtemp(prefix="rf-demo-")
    path = os.path.join(d, "secret")
    security.write_secret(path)
    security.use(security.resolve(path, False))
    try:
        yield path
    finally:
        security.use(None)
        shutil.rmtree(d, ignore_errors=True)


def _checksum(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        words = obj.view(torch.uint8)
        if words.numel() % 8 == 0:  # sum 64-bit words: 8x fewer additions than bytes
            words = words.view(torch.int64)
        return int(words.sum(dtype=torch.int64))
    return zlib.crc32(repr(obj).encode())


def _reader(handle: bytes, rank: int, local: bool, conn, policy) -> None:
    security.use(policy)  # the demo's security policy, handed over explicitly
    bq = MessageQueue.create_from_handle(handle, rank)
    rq = MessageQueue(1, 1 if local else 0, max_chunk_bytes=1 << 16, max_chunks=8, connect_ip="127.0.0.1")
    conn.send_bytes(rq.export_handle().to_bytes())
    with bq, rq:
        bq.wait_until_ready(timeout=120)
        rq.wait_until_ready(timeout=120)
        while True:
            msg = bq.dequeue(timeout=120)
            if isinstance(msg, str) and msg == STOP:
                break
            i, payload = msg
            rq.enqueue((i, _checksum(payload)), timeout=60)
            del msg, payload


def _payload(i: int):
    import torch

    if i % 50 == 49:
        return torch.full((32 << 20,), i % 7, dtype=torch.uint8)
    if i % 10 == 9:
        return torch.full((1 << 20,), float(i), dtype=torch.float32)  # 4 MiB
    if i % 3 == 2:
        return torch.arange(16 << 10, dtype=torch.int32) + i  # 64 KiB
    return {"step": i, "tokens": list(range(i % 16))}


def run_engine_demo(tp: int, pp: int, steps: int, dp: int = 1) -> int:
    """One node: the executor(s) in this process (with DP, one per replica, in one world)."""
    from rayfree.cluster.config import ClusterConfig, ParallelConfig
    from rayfree.executor.replicas import NodeReplicas
    from rayfree.transport.net import get_open_port

    from .demo_driver import drive

    if steps < 1 or dp < 1:
        print("rayfree demo: --steps and --dp must be >= 1", file=sys.stderr)
        return 2
    config = ClusterConfig(
        parallel=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            master_port=get_open_port("127.0.0.1"),
        )
    )
    n = config.parallel.world_size_across_dp
    print(
        f"rayfree demo: toy engine, {f'DP={dp} x ' if dp > 1 else ''}TP={tp} x PP={pp} = {n} workers on this "
        f"node, {steps} steps"
    )
    print(f"  starting {n} workers (spawn, torch, gloo world and groups, model, queues) ...", flush=True)
    t0 = time.perf_counter()
    reps = NodeReplicas(config, "rayfree.cli.toy_engine:ToyWorker")
    try:
        print(f"  ready in {time.perf_counter() - t0:.1f} s")
        codes = reps.run(lambda ex: drive(ex, steps))
    finally:
        reps.shutdown()
    clean = all(w.proc.exitcode == 0 for ex in reps.executors for w in ex.workers)
    ok = all(c == 0 for c in codes) and clean
    print(f"  {'all outputs match the single-process model; workers exited cleanly' if ok else 'FAILED'}")
    return 0 if ok else 1


def run_transport_demo(n_local: int, n_remote: int, n_messages: int) -> int:
    if n_remote:
        with demo_secret():
            return _run_transport_demo(n_local, n_remote, n_messages)
    return _run_transport_demo(n_local, n_remote, n_messages)


def _run_transport_demo(n_local: int, n_remote: int, n_messages: int) -> int:
    import torch

    if n_local < 0 or n_remote < 0 or n_local + n_remote < 1:
        print("rayfree demo: need at least one reader (--readers / --remote)", file=sys.stderr)
        return 2
    n = n_local + n_remote
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    print(
        f"rayfree demo: 1 writer -> {n_local} local reader(s) over shared memory, "
        f"{n_remote} remote over TCP 127.0.0.1; {n_messages} messages"
    )
    bq = MessageQueue(n, n_local, connect_ip="127.0.0.1")
    procs, replies = [], []
    try:
        h = bq.export_handle().to_bytes()
        conns = []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(
                target=_reader, args=(h, r, r < n_local, b, security.current()), name=f"reader-{r}", daemon=True
            )
            p.start()
            procs.append(p)
            conns.append(a)
        for r, c in enumerate(conns):
            if not c.poll(120):
                raise RuntimeError(f"reader {r} did not start within 120 s")
            replies.append(MessageQueue.create_from_handle(c.recv_bytes(), 0))
        bq.wait_until_ready(timeout=120)
        for rq in replies:
            rq.wait_until_ready(timeout=120)
        t_ready = time.perf_counter()
        print(f"  {n} readers ready in {t_ready - t_start:.1f} s")
        tty = sys.stdout.isatty()
        rtts: list[float] = []
        sent_bytes = 0
        bad = 0
        for i in range(n_messages):
            payload = _payload(i)
            want = _checksum(payload)
            sent_bytes += payload.numel() * payload.element_size() if isinstance(payload, torch.Tensor) else 0
            t0 = time.perf_counter()
            bq.enqueue((i, payload), timeout=60)
            for rq in replies:
                j, got = rq.dequeue(timeout=60)
                bad += (j != i) or (got != want)
            if not isinstance(payload, torch.Tensor):
                rtts.append(time.perf_counter() - t0)
            if tty and (i % 10 == 0 or i == n_messages - 1):
                print(f"\r  sent {i + 1}/{n_messages}", end="", flush=True)
            elif not tty and ((i + 1) % 100 == 0 or i == n_messages - 1):
                print(f"  sent {i + 1}/{n_messages}", flush=True)
        bq.enqueue(STOP, timeout=10)
        t_end = time.perf_counter()
        if tty:
            print()
        for p in procs:
            p.join(30)
    finally:
        bq.close()
        for rq in replies:
            rq.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    exitcodes = [p.exitcode for p in procs]
    rtts.sort()
    print()
    print(f"  {'reader':<8}{'path':<6}{'messages':>10}{'checks':>8}")
    for r in range(n):
        print(f"  {r:<8}{'shm' if r < n_local else 'tcp':<6}{n_messages:>10}{'ok' if not bad else 'BAD':>8}")
    print()
    span = t_end - t_ready
    print(
        f"  payload bytes broadcast: {sent_bytes / 2**20:.0f} MiB in {span:.2f} s "
        f"({sent_bytes * n / span / 1e9:.2f} GB/s delivered to {n} readers)"
    )
    if rtts:
        print(
            f"  control-message round trip (all readers answer): p50 {statistics.median(rtts) * 1e6:.0f} us, "
            f"p99 {rtts[int(0.99 * (len(rtts) - 1))] * 1e6:.0f} us"
        )
    ok = bad == 0 and all(c == 0 for c in exitcodes)
    print(
        f"  {'all payloads verified, readers exited cleanly' if ok else f'FAILED: {bad} bad replies, exit codes {exitcodes}'}"  # noqa: E501
    )
    return 0 if ok else 1
