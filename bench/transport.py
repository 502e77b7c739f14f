"""Transport benchmark: broadcast round trips through MessageQueue, beside baselines of the same run.

A round trip is what the executor does: the writer broadcasts a payload to N
readers; reader 0 replies with a tiny message through its own one-reader
queue. Baselines measured in the same run: one `multiprocessing.Pipe` per
reader (pickle + pipe), a single-thread memcpy of the payload into touched
memory (the physical floor), and an os.pipe ping-pong (the blocking wake-up
floor, for the paced case).

    python bench/transport.py            # full table (~1-2 min on 2 cores)
    python bench/transport.py --quick    # fewer iterations
    python bench/transport.py --shared 1,2,4 --payloads 32MiB --rounds 3   # big payloads shared vs copied
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import resource
import statistics
import sys
import time

# This directory's vllm.py would shadow the vllm package (the shared-reads table's arena column).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayfree.procs import cpu_seconds  # noqa: E402
from rayfree.transport import MessageQueue  # noqa: E402
from rayfree.transport.secure import policy as security  # noqa: E402

STOP = ("__stop__",)


def payloads(quick: bool):
    import torch

    it = (lambda n: max(5, n // 4)) if quick else (lambda n: n)
    return [
        ("tiny", ("execute_model", (b"x" * 40,), {"step": 1}, 0), it(3000)),
        ("64KiB", torch.zeros(64 << 10, dtype=torch.uint8), it(1000)),
        ("1MiB", torch.zeros(1 << 20, dtype=torch.uint8), it(400)),
        ("4MiB", torch.zeros(4 << 20, dtype=torch.uint8), it(200)),
        ("32MiB", torch.zeros(32 << 20, dtype=torch.uint8), it(60)),
    ]


def nbytes(obj) -> int:
    try:
        return obj.numel() * obj.element_size()
    except AttributeError:
        return len(pickle.dumps(obj, 5))


# -- MessageQueue readers -------------------------------------------------------


def mq_reader(
    handle: bytes, rank: int, reply_conn, local_reply: bool, policy=None, zero_copy: bool = False, answer=None
) -> None:
    """Reader `rank`; reader 0 answers each message with b"ok", or with what `answer()`'s function makes of it
    (every reader runs that function: bench/step.py's compute)."""
    __import__("torch")  # import it before timing starts: readers rebuild tensors
    work = None if answer is None else answer()
    security.use(policy)  # the bench's cluster secret, handed over explicitly
    bq = MessageQueue.create_from_handle(handle, rank, zero_copy=zero_copy)
    rq = None
    if rank == 0:
        rq = MessageQueue(1, 1 if local_reply else 0, max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1")
        reply_conn.send_bytes(rq.export_handle().to_bytes())
    bq.wait_until_ready(timeout=60)
    if rq is not None:
        rq.wait_until_ready(timeout=60)
    reply_conn.send_bytes(b"ready")
    while True:
        msg = bq.dequeue(indefinite=True)
        if type(msg) is tuple and msg == STOP:
            break
        reply = b"ok" if work is None else work(msg)
        if rq is not None:
            rq.enqueue(reply)
        del msg
    bq.close()
    if rq is not None:
        rq.close(flush_timeout=0)  # the bench reads no CLOSE on the reply queue


class MQRig:
    def __init__(self, n_local: int, n_remote: int, zero_copy: bool = False, answer=None) -> None:
        ctx = mp.get_context("spawn")
        n = n_local + n_remote
        self.bq = MessageQueue(n, n_local, connect_ip="127.0.0.1")
        h = self.bq.export_handle().to_bytes()
        self.procs, conns = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            args = (h, r, b, n_remote == 0, security.current(), zero_copy, answer)
            p = ctx.Process(target=mq_reader, args=args, daemon=True)
            p.start()
            self.procs.append(p)
            conns.append(a)
        if not conns[0].poll(120):
            raise RuntimeError("reader 0 did not start")
        self.rq = MessageQueue.create_from_handle(conns[0].recv_bytes(), 0)
        self.bq.wait_until_ready(timeout=60)
        self.rq.wait_until_ready(timeout=60)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("a reader did not become ready")
            c.recv_bytes()

    def round_trip(self, obj) -> float:
        t0 = time.perf_counter()
        self.bq.enqueue(obj)
        self.rq.dequeue(timeout=60)
        return time.perf_counter() - t0

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self.bq.enqueue(STOP)
        for p in self.procs:
            p.join(30)
        self.bq.close(flush_timeout=0)  # the readers have read STOP and left: no CLOSE to confirm
        self.rq.close()


# -- Pipe baseline ----------------------------------------------------------------


def pipe_reader(conn, rank: int) -> None:
    __import__("torch")  # import it before timing starts
    while True:
        data = conn.recv_bytes()
        obj = pickle.loads(data)
        if type(obj) is tuple and obj == STOP:
            break
        if rank == 0:
            conn.send_bytes(b"ok")
        del obj, data


class PipeRig:
    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=pipe_reader, args=(b, r), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.round_trip(("warm",))

    def round_trip(self, obj) -> float:
        t0 = time.perf_counter()
        data = pickle.dumps(obj, 5)
        for c in self.conns:
            c.send_bytes(data)
        self.conns[0].recv_bytes()
        return time.perf_counter() - t0

    def close(self) -> None:
        data = pickle.dumps(STOP)
        for c in self.conns:
            c.send_bytes(data)
        for p in self.procs:
            p.join(30)


# -- floors -----------------------------------------------------------------------


def memcpy_time(obj, iters: int) -> float:
    import ctypes

    n = nbytes(obj)
    if hasattr(obj, "data_ptr"):
        src = (ctypes.c_char * n).from_address(obj.data_ptr())
    else:
        src = bytearray(pickle.dumps(obj, 5))
    dst = bytearray(n)
    dv, sv = memoryview(dst), memoryview(src).cast("B")
    dv[:] = sv  # touch
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dv[:] = sv
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def memcpy_fresh_time(obj, iters: int) -> float:
    """A single-thread copy of the payload into memory never touched before (a new mapping each time):
    what a private copy costs when nothing is reused, page faults included."""
    import ctypes
    import mmap

    n = nbytes(obj)
    if hasattr(obj, "data_ptr"):
        src = (ctypes.c_char * n).from_address(obj.data_ptr())
    else:
        src = bytearray(pickle.dumps(obj, 5))
    sv = memoryview(src).cast("B")
    ts = []
    for _ in range(iters):
        m = mmap.mmap(-1, max(n, 1))
        dv = memoryview(m)
        t0 = time.perf_counter()
        dv[:n] = sv
        ts.append(time.perf_counter() - t0)
        dv.release()
        m.close()
    return statistics.median(ts)


def _pipe_pong(r: int, w: int) -> None:
    while True:
        b = os.read(r, 1)
        if not b or b == b"q":
            return
        os.write(w, b)


def os_pipe_pingpong(count: int, period: float) -> float:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no torch work in here, so fork is safe
        os.close(w1)
        os.close(r2)
        _pipe_pong(r1, w2)
        os._exit(0)
    ts = []
    nxt = time.perf_counter()
    for _ in range(count):
        nxt += period
        while time.perf_counter() < nxt:
            time.sleep(max(0.0, nxt - time.perf_counter() - 0.0005))
        t0 = time.perf_counter()
        os.write(w1, b"x")
        os.read(r2, 1)
        ts.append(time.perf_counter() - t0)
    os.write(w1, b"q")
    os.waitpid(pid, 0)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    return statistics.median(ts)


def _zmq_pong(port: str, conn) -> None:
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    conn.send(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    pub.recv()  # our subscriber arrived
    while sub.recv() != b"q":
        pub.send(b"ok")
    ctx.destroy(linger=0)


def zmq_pingpong(count: int) -> float:
    """Raw pyzmq XPUB/SUB ping-pong over TCP loopback: the floor of the remote path."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(
        target=_zmq_pong, args=(pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1], b), daemon=True
    )
    p.start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(a.recv())
    pub.recv()  # the child's subscriber arrived
    while True:  # until the child's publisher has our subscription too
        pub.send(b"x" * 100)
        if sub.poll(100):
            sub.recv()
            break
    ts = []
    for _ in range(count):
        t0 = time.perf_counter()
        pub.send(b"x" * 100)
        sub.recv()
        ts.append(time.perf_counter() - t0)
    pub.send(b"q")
    p.join(10)
    ctx.destroy(linger=0)
    return statistics.median(ts[count // 10 :])


# -- remote paths: sealed (default) vs insecure vs the raw floors ---------------------------------------


def _floor_sub(port: str, idx: int, conn) -> None:
    """A raw pyzmq subscriber; subscriber 0 answers each message with a small reply."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    rep = None
    if idx == 0:
        rep = ctx.socket(zmq.PUSH)
        rep.connect(conn.recv())
    conn.send(b"ready")
    while True:
        frames = sub.recv_multipart(copy=False)
        if len(frames[0]) == 1 and frames[0].bytes == b"q":  # (.bytes copies: only on the 1-byte stop)
            break
        if rep is not None:
            rep.send(b"ok")
    ctx.destroy(linger=0)


class FloorRig:
    """Raw pyzmq zero-copy XPUB/SUB round trip of the payload's bytes to `n_sub` subscribers, then a small
    reply from one: what the remote path costs with neither pickle nor security."""

    def __init__(self, n_sub: int) -> None:
        import zmq

        self.ctx = ctx = zmq.Context()
        self.pub = pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        pub.bind("tcp://127.0.0.1:*")
        self.pull = pull = ctx.socket(zmq.PULL)
        pull.bind("tcp://127.0.0.1:*")
        port = pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        spawn = mp.get_context("spawn")
        self.procs, conns = [], []
        for i in range(n_sub):
            a, b = spawn.Pipe()
            p = spawn.Process(target=_floor_sub, args=(port, i, b), daemon=True)
            p.start()
            if i == 0:
                a.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
            self.procs.append(p)
            conns.append(a)
        for c in conns:
            c.recv()
        for _ in range(n_sub):
            pub.recv()  # every subscription arrived
        self._obj = self._payload = None

    def round_trip(self, obj) -> float:
        if obj is not self._obj:
            self._obj, self._payload = obj, memoryview(ctypes_buffer(obj))
        payload = self._payload
        t0 = time.perf_counter()
        self.pub.send(payload, copy=len(payload) < 65536)
        self.pull.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pub.send(b"q")
        for p in self.procs:
            p.join(10)
        self.ctx.destroy(linger=0)


def ctypes_buffer(obj):
    import ctypes

    if hasattr(obj, "data_ptr"):
        return (ctypes.c_char * nbytes(obj)).from_address(obj.data_ptr())
    return bytearray(pickle.dumps(obj, 5))


def seal_open_ms(obj) -> tuple[float, float]:
    """Sealing the payload once and opening it once with the queue's AEAD, the way the queue does it (one
    message, or segments from SEG_MIN on), warm buffers, in ms."""
    from rayfree.transport.secure.aead import Sealer
    from rayfree.transport.secure.opener import Opener

    key, qid = os.urandom(32), os.urandom(16)
    frames = [memoryview(ctypes_buffer(obj)).cast("B")]
    s, o = Sealer(key, qid), Opener(key, qid)
    best_s = best_o = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        segmented = s.segments(frames)
        sealed = s.seal(frames) if segmented is None else list(segmented[1])
        t1 = time.perf_counter()
        if segmented is None:
            out = o.open([memoryview(f) for f in sealed])
        else:
            for seg in sealed:
                out = o.open([seg])
        t2 = time.perf_counter()
        assert out is not None
        del out
        s.give_back(sealed if segmented is None else [None, segmented[0]])
        best_s, best_o = min(best_s, t1 - t0), min(best_o, t2 - t1)
    return best_s * 1e3, best_o * 1e3


def run_seconds(pid: int) -> float:
    """The CPU time every thread of process `pid` has run so far, to the nanosecond (/proc's schedstat; the
    clock ticks of /proc/PID/stat are 10 ms, as long as a whole round of small messages)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return total / 1e9


def _cpu_per_message(rig, obj, iters: int) -> tuple[float, list[float], float]:
    """One measured round of `rig`: its p50, and the CPU (user + system) each message cost the writer's process
    (this one: the idle rigs in it use none) and each reader, in seconds."""
    pids = rig.pids()
    warm = max(3, iters // 10)
    for _ in range(warm):
        rig.round_trip(obj)
    r0, c0 = resource.getrusage(resource.RUSAGE_SELF), [run_seconds(p) for p in pids]
    ts = [rig.round_trip(obj) for _ in range(iters)]
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), [run_seconds(p) for p in pids]
    writer = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / iters
    return pct(ts, 0.5), [(b - a) / iters for a, b in zip(c0, c1)], writer


def remote_table(loads, readers: list[int], iters_of, rounds: int = 5) -> None:
    """Sealed (the default), insecure and the raw floor for each reader count and payload: all three rigs up
    at once (idle ones block), measured in alternating rounds; each figure is the median of the rounds' p50s,
    so drift on a busy machine hits the three alike. Then what sealing cost in CPU per message: the writer's
    process (one seal whatever the number of readers) and each reader (one open)."""
    from rayfree.transport.secure import policy as security

    sealed_policy = security.current()
    print(
        f"remote paths (TCP loopback): round trip = broadcast to N readers + a reply from reader 0, us; the "
        f"median over {rounds} alternating rounds of each rig's p50"
    )
    hdr = (
        f"{'N':>3} {'payload':>8} {'sealed':>10} {'insecure':>10} {'zmq floor':>10} {'insec/floor':>11} "
        f"{'sealed-insec':>12} {'seal+open':>10} {'sealed/insec':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    cpu_rows = []
    for n in readers:
        rigs: dict = {}
        try:
            rigs["sealed"] = MQRig(0, n)  # made under the bench's secret
            security.use(security.Policy(None, True))
            try:
                rigs["insecure"] = MQRig(0, n)
            finally:
                security.use(sealed_policy)
            rigs["floor"] = FloorRig(n)
            for name, obj, _ in loads:
                per: dict[str, list[float]] = {k: [] for k in rigs}
                cpu: dict[str, list] = {"sealed": [], "insecure": []}
                for _ in range(rounds):
                    for k, rig in rigs.items():
                        if k in cpu:
                            p50, reader_cpu, writer_cpu = _cpu_per_message(rig, obj, iters_of(name))
                            cpu[k].append((writer_cpu, sum(reader_cpu) / n))
                        else:
                            p50 = pct(measure(rig, obj, iters_of(name)), 0.5)
                        per[k].append(p50)
                med = {k: statistics.median(v) for k, v in per.items()}
                so = seal_open_ms(obj)
                s, i, f = med["sealed"], med["insecure"], med["floor"]
                print(
                    f"{n:>3} {name:>8} {s * 1e6:>10.1f} {i * 1e6:>10.1f} {f * 1e6:>10.1f} {i / f:>11.2f} "
                    f"{(s - i) * 1e6:>12.1f} {(so[0] + so[1]) * 1e3:>10.1f} {s / i:>12.2f}",
                    flush=True,
                )
                w = {k: statistics.median(x[0] for x in v) for k, v in cpu.items()}
                r = {k: statistics.median(x[1] for x in v) for k, v in cpu.items()}
                cpu_rows.append((n, name, w["sealed"], w["insecure"], r["sealed"], r["insecure"], so))
        finally:
            for rig in rigs.values():
                rig.close()
    print()
    print(
        "CPU per message, us (user + system, every thread; median over the rounds): the writer's process "
        "(getrusage), and a reader's (the mean of the N; /proc's schedstat, every thread)"
    )
    hdr = (
        f"{'N':>3} {'payload':>8} {'writer sealed':>13} {'insecure':>9} {'extra':>8} {'seal':>8} "
        f"{'reader sealed':>13} {'insecure':>9} {'extra':>8} {'open':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n, name, ws, wi, rs, ri, so in cpu_rows:
        print(
            f"{n:>3} {name:>8} {ws * 1e6:>13.1f} {wi * 1e6:>9.1f} {(ws - wi) * 1e6:>8.1f} {so[0] * 1e3:>8.1f} "
            f"{rs * 1e6:>13.1f} {ri * 1e6:>9.1f} {(rs - ri) * 1e6:>8.1f} {so[1] * 1e3:>8.1f}",
            flush=True,
        )


def fence_cost_ns(n: int = 200_000) -> float:
    """One inlined fence (a lock's acquire + release), less the loop around it."""
    from rayfree.transport.shm.ring import _acquire, _release

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            _acquire()
            _release()
        t1 = time.perf_counter()
        for _ in range(n):
            pass
        best = min(best, ((t1 - t0) - (time.perf_counter() - t1)) / n)
    return best * 1e9


def fence_ab(iters: int, rounds: int = 3) -> tuple[float, float]:
    """Local N=1 tiny round trip p50 with the ring's fences as on aarch64 (RAYFREE_RING_FENCES=always) and as
    on this CPU (auto), same run, interleaved; the readers inherit the setting."""
    tiny = payloads(True)[0][1]
    got: dict[str, list[float]] = {"always": [], "auto": []}
    saved = os.environ.get("RAYFREE_RING_FENCES")
    try:
        for _ in range(rounds):
            for mode in got:
                os.environ["RAYFREE_RING_FENCES"] = mode
                rig = MQRig(1, 0)
                try:
                    got[mode] += measure(rig, tiny, iters)
                finally:
                    rig.close()
    finally:
        if saved is None:
            os.environ.pop("RAYFREE_RING_FENCES", None)
        else:
            os.environ["RAYFREE_RING_FENCES"] = saved
    return pct(got["always"], 0.5), pct(got["auto"], 0.5)


def vllm_reader(handle, rank: int, reply_conn, policy=None) -> None:
    """A reader of vLLM's own MessageQueue (its tensor arena on); reader 0 replies through a rayfree queue."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmQueue

    security.use(policy)  # (the reply queue's handle is signed with the bench's secret)

    bq = VllmQueue.create_from_handle(handle, rank)
    rq = None
    if rank == 0:
        rq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1")
        reply_conn.send_bytes(rq.export_handle().to_bytes())
    bq.wait_until_ready()
    if rq is not None:
        rq.wait_until_ready(timeout=60)
    reply_conn.send_bytes(b"ready")
    while True:
        msg = bq.dequeue()
        if type(msg) is tuple and msg == STOP:
            break
        if rq is not None:
            rq.enqueue(b"ok")
        del msg
    if rq is not None:
        rq.close(flush_timeout=0)


class VllmArenaRig(MQRig):
    """vLLM's MessageQueue with `enable_shm_tensor_arena` (readers get views of shared slots for big tensors),
    to N local readers: the peer the shared path is held to."""

    def __init__(self, n: int) -> None:
        import threading

        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmQueue

        ctx = mp.get_context("spawn")
        self.bq = VllmQueue(n, n, max_chunk_bytes=1 << 22, max_chunks=24, enable_shm_tensor_arena=True)
        h = self.bq.export_handle()
        self.procs, conns = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=vllm_reader, args=(h, r, b, security.current()), daemon=True)
            p.start()
            self.procs.append(p)
            conns.append(a)
        ready = threading.Thread(target=self.bq.wait_until_ready, daemon=True)  # (collective with the readers)
        ready.start()
        if not conns[0].poll(120):
            raise RuntimeError("vLLM reader 0 did not start")
        self.rq = MessageQueue.create_from_handle(conns[0].recv_bytes(), 0)
        self.rq.wait_until_ready(timeout=60)
        ready.join(60)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("a vLLM reader did not become ready")
            c.recv_bytes()

    def close(self) -> None:
        self.bq.enqueue(STOP)
        for p in self.procs:
            p.join(30)
        self.rq.close()


def _has_vllm() -> bool:
    try:
        __import__("vllm.distributed.device_communicators.shm_tensor_arena")
    except Exception:  # noqa: BLE001 - vLLM is optional here: no such column without it
        return False
    return True


def shared_table(loads, readers: list[int], iters_of, rounds: int) -> None:
    """Big payloads to N local readers: each reader's own copy (the default) against views of the ring
    (`zero_copy`, what `shared_arguments` gives workers), in alternating rounds, beside one memcpy of the payload
    (the floor of any path that puts it into shared memory once)."""
    vllm = _has_vllm()
    print(
        f"shared reads: private copies vs views of the ring (zero_copy){' vs vLLM tensor arena' if vllm else ''}, "
        f"{rounds} alternating round(s), p50 of the round medians; memcpy = one copy into warm memory"
        + ("" if vllm else " (vLLM is not importable here: run with its venv for the arena column)")
    )
    hdr = (
        f"{'N':>3} {'payload':>8} {'private us':>11} {'shared us':>10} {'shared/priv':>11} {'memcpy us':>10} "
        f"{'shared/memcpy':>13}" + (f" {'vllm arena us':>13} {'shared/arena':>12}" if vllm else "")
    )
    print(hdr)
    print("-" * len(hdr))
    for n in readers:
        for name, obj, _ in loads:
            iters = iters_of(name)
            kinds = ["private", "shared"] + (["arena"] if vllm else [])
            med: dict[str, list[float]] = {k: [] for k in kinds}
            for i in range(rounds):
                for kind in kinds if i % 2 == 0 else kinds[::-1]:
                    rig = VllmArenaRig(n) if kind == "arena" else MQRig(n, 0, zero_copy=kind == "shared")
                    try:
                        med[kind].append(statistics.median(measure(rig, obj, iters)))
                    finally:
                        rig.close()
            priv, shared = statistics.median(med["private"]), statistics.median(med["shared"])
            floor = memcpy_time(obj, 20)
            arena = statistics.median(med["arena"]) if vllm else 0.0
            print(
                f"{n:>3} {name:>8} {priv * 1e6:>11.0f} {shared * 1e6:>10.0f} {shared / priv:>11.2f} "
                f"{floor * 1e6:>10.0f} {shared / floor:>13.2f}"
                + (f" {arena * 1e6:>13.0f} {shared / arena:>12.2f}" if vllm else ""),
                flush=True,
            )
    print()


def pct(ts: list[float], q: float) -> float:
    s = sorted(ts)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(rig, obj, iters: int) -> list[float]:
    warm = max(3, iters // 10)
    for _ in range(warm):
        rig.round_trip(obj)
    return [rig.round_trip(obj) for _ in range(iters)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--payloads", default="tiny,64KiB,4MiB,32MiB", help="comma-separated subset (or 1MiB)")
    ap.add_argument("--configs", default="local1,local2,local4,remote1", help="comma-separated subset")
    ap.add_argument("--no-paced", action="store_true", help="skip the paced case")
    ap.add_argument("--no-fence-ab", action="store_true", help="skip the fence cost measurement")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds of the sealed/insecure/floor table "
        "(more: steadier ratios on a machine whose speed drifts)",
    )
    ap.add_argument(
        "--remote-readers", default="1,4", help="reader counts of the sealed/insecure/floor table ('' to skip it)"
    )
    ap.add_argument(
        "--shared",
        default="",
        help="only the shared-reads table, for these local reader counts (e.g. 1,2,4) and --payloads",
    )
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    wanted = args.payloads.split(",")
    loads = [p for p in payloads(args.quick) if p[0] in wanted]
    if args.shared:
        shared_table(
            [p for p in loads if p[0] != "tiny"],
            [int(x) for x in args.shared.split(",")],
            lambda name: 10 if args.quick else {"32MiB": 40}.get(name, 100),
            max(1, args.rounds),
        )
        return
    floors = {name: memcpy_time(obj, 20 if name != "tiny" else 2000) for name, obj, _ in loads}
    fresh = {name: memcpy_fresh_time(obj, 10 if name != "tiny" else 200) for name, obj, _ in loads}
    print(
        f"rayfree transport bench: {os.cpu_count()} cores, torch {torch.__version__}, "
        f"spin budget {os.environ.get('RAYFREE_SPIN_US', 'default')} us"
    )
    print()
    print(
        "every reader gets its own writable copy of each tensor (vLLM's semantics); memcpy: one copy of the "
        "payload into warm memory / into fresh memory (page faults), same run"
    )
    print()
    hdr = (
        f"{'path':<10}{'N':>3} {'payload':>8} {'p50 us':>10} {'p99 us':>10} {'GB/s':>7} "
        f"{'Pipe p50':>10} {'vs Pipe':>8} {'memcpy us':>10} {'vs memcpy':>9} {'fresh us':>9} {'vs fresh':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    parked = {}
    configs = {"local1": (1, 0), "local2": (2, 0), "local4": (4, 0), "remote1": (0, 1)}
    for key in filter(None, args.configs.split(",")):
        n_local, n_remote = configs[key]
        n = n_local + n_remote
        label = "local" if n_remote == 0 else "remote"
        rig = MQRig(n_local, n_remote)
        results = {}
        try:
            for name, obj, iters in loads:
                results[name] = measure(rig, obj, iters)
            before = {pid: cpu_seconds(pid) for pid in rig.pids()}
            t0 = time.perf_counter()
            time.sleep(3.0)
            wall = time.perf_counter() - t0
            parked[(label, n)] = max((cpu_seconds(pid) - before[pid]) / wall * 100 for pid in rig.pids())
        finally:
            rig.close()
        prig = PipeRig(n)
        try:
            pres = {name: measure(prig, obj, max(5, iters // 4)) for name, obj, iters in loads}
        finally:
            prig.close()
        for name, obj, _ in loads:
            ts = results[name]
            p50, p99 = pct(ts, 0.5), pct(ts, 0.99)
            pp50 = pct(pres[name], 0.5)
            size = nbytes(obj)
            gbs = size / p50 / 1e9
            print(
                f"{label:<10}{n:>3} {name:>8} {p50 * 1e6:>10.1f} {p99 * 1e6:>10.1f} {gbs:>7.2f} "
                f"{pp50 * 1e6:>10.1f} {p50 / pp50:>8.2f} {floors[name] * 1e6:>10.1f} "
                f"{p50 / floors[name]:>9.2f} {fresh[name] * 1e6:>9.1f} {p50 / fresh[name]:>8.2f}",
                flush=True,
            )
    print()
    if "remote1" in args.configs.split(","):
        print(f"remote floor: raw pyzmq XPUB/SUB ping-pong (100 B, no pickle) p50 {zmq_pingpong(2000) * 1e6:.1f} us")
    for (label, n), cpu in parked.items():
        print(f"readers parked 3 s ({label}, N={n}): max CPU {cpu:.2f}%")
    if not args.no_fence_ab:
        with_f, without = fence_ab(max(200, 3000 // (4 if args.quick else 1)))
        from rayfree.transport.shm.ring import _TSO

        print(
            f"fence: {fence_cost_ns():.0f} ns per fence; local N=1 tiny round trip p50 {with_f * 1e6:.1f} us with "
            f"aarch64's fences (8 a round trip), {without * 1e6:.1f} us with this CPU's "
            f"({'4: x86 needs only the store->load ones' if _TSO else 'the same 8'}); "
            f"{(with_f / without - 1) * 100:+.0f}%"
        )
    readers = [int(x) for x in args.remote_readers.split(",") if x]
    if readers:
        print()
        remote_loads = [(name, obj, it) for name, obj, it in loads if name != "64KiB"]
        remote_table(
            remote_loads,
            readers,
            lambda name: {"tiny": 1000, "4MiB": 40, "32MiB": 10}.get(name, 40) if not args.quick else 10,
            max(1, args.rounds),
        )
    if args.no_paced:
        return
    # Paced: an engine's decode loop, one message every 5 ms.
    tiny = payloads(True)[0][1]
    period, duration = 0.005, 2.0
    count = int(duration / period)
    rig = MQRig(2, 0)
    try:
        before = {pid: cpu_seconds(pid) for pid in rig.pids()}
        t_start = time.perf_counter()
        ts = []
        nxt = t_start
        for _ in range(count):
            nxt += period
            while time.perf_counter() < nxt:
                time.sleep(max(0.0, nxt - time.perf_counter() - 0.0005))
            ts.append(rig.round_trip(tiny))
        wall = time.perf_counter() - t_start
        cpu = [(cpu_seconds(pid) - before[pid]) / wall * 100 for pid in rig.pids()]
    finally:
        rig.close()
    pipe_p50 = os_pipe_pingpong(count, period)
    p50 = statistics.median(ts)
    print(
        f"paced N=2, 1 msg / {period * 1e3:.0f} ms for {duration:.0f} s: p50 {p50 * 1e6:.1f} us "
        f"(os.pipe ping-pong {pipe_p50 * 1e6:.1f} us, ratio {p50 / pipe_p50:.2f}); "
        f"readers' CPU {', '.join(f'{c:.1f}%' for c in cpu)}"
    )


if __name__ == "__main__":
    from rayfree.cli.demo import demo_secret

    with demo_secret():  # the remote paths are TCP, which needs a cluster secret (a throwaway one here)
        main()
