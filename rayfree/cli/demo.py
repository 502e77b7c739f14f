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

from rayfree import settings
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


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _topology(ex) -> list[dict]:
    from rayfree.worker.proc import worker_info

    return sorted(ex.collective_rpc(worker_info, timeout=60), key=lambda r: r["rank"])


def drive(ex, steps: int | None = None) -> int:
    """The demo engine's driver (`rayfree node --entry rayfree.cli.demo:drive`): topology, steps, latency table.

    Steps come from RAYFREE_DEMO_STEPS (default 200); RAYFREE_DEMO_T0 (a time.time()) makes it say how long
    the cluster took to become ready. With DP, each replica's leader runs it on its own batches, and every
    line says which replica it is about.
    """
    import torch

    from rayfree.cli.toy_engine import dp_sum, make_batch, reference_forward
    from rayfree.cluster.join import coupling_of

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
    step, until = 0, time.monotonic() + 180
    while step < steps or (heard is not None and "serving" not in heard and time.monotonic() < until):
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
    return 0 if bad == 0 and bad_dp == 0 else 1


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


def run_engine_demo(tp: int, pp: int, steps: int, dp: int = 1) -> int:
    """One node: the executor(s) in this process (with DP, one per replica, in one world)."""
    from rayfree.cluster.config import ClusterConfig, ParallelConfig
    from rayfree.executor.replicas import NodeReplicas
    from rayfree.transport.net import get_open_port

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
