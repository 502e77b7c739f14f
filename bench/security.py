"""The cost of security on the remote path: CURVE (authenticated, encrypted) vs --insecure plain TCP.

One writer, one remote reader on 127.0.0.1 in another process, which answers through its own
one-reader TCP queue (so both directions pay). Tiny: round trip of a small control message, p50.
4 MiB: a 4 MiB tensor out, a tiny ack back, throughput. Both modes in the same run, interleaved
(secure, insecure, secure, insecure) so the VM's drift hits both alike.

    python bench/security.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _reader(handle: bytes, conn, policy) -> None:
    from rayfree.transport import MessageQueue
    from rayfree.transport.secure import policy as security

    security.use(policy)
    rq = MessageQueue(1, 0, connect_ip="127.0.0.1", max_chunk_bytes=1 << 16, max_chunks=8)
    conn.send_bytes(rq.export_handle().to_bytes())
    bq = MessageQueue.create_from_handle(handle, 0)
    with bq, rq:
        bq.wait_until_ready(timeout=60)
        rq.wait_until_ready(timeout=60)
        while True:
            m = bq.dequeue(timeout=120)
            if m == "stop":
                return
            rq.enqueue(1, timeout=60)


def run(mode: str, n_tiny: int, n_big: int) -> dict[str, float]:
    import torch

    from rayfree.transport import MessageQueue
    from rayfree.transport.secure import policy as security

    saved = security.current()
    if mode == "insecure":
        security.use(security.Policy(None, True))
    ctx = mp.get_context("spawn")
    bq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_reader, args=(bq.export_handle().to_bytes(), b, security.current()), daemon=True)
    p.start()
    try:
        if not a.poll(120):
            raise RuntimeError("the reader did not start")
        rq = MessageQueue.create_from_handle(a.recv_bytes(), 0)
        bq.wait_until_ready(timeout=60)
        rq.wait_until_ready(timeout=60)
        tiny = {"op": "step", "ids": list(range(8))}
        for _ in range(200):
            bq.enqueue(tiny)
            rq.dequeue(timeout=60)
        rtts = []
        for _ in range(n_tiny):
            t0 = time.perf_counter()
            bq.enqueue(tiny)
            rq.dequeue(timeout=60)
            rtts.append(time.perf_counter() - t0)
        big = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
        bq.enqueue(big)
        rq.dequeue(timeout=60)
        t0 = time.perf_counter()
        for _ in range(n_big):
            bq.enqueue(big)
            rq.dequeue(timeout=60)
        span = time.perf_counter() - t0
        bq.enqueue("stop")
        p.join(30)
        rq.close()
    finally:
        bq.close()
        if p.is_alive():
            p.kill()
        security.use(saved)
    return {"tiny_p50_us": statistics.median(rtts) * 1e6, "big_GBps": n_big * (4 << 20) / span / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_tiny, n_big = (500, 20) if args.quick else (3000, 100)
    res: dict[str, list[dict[str, float]]] = {"curve": [], "insecure": []}
    for rnd in range(2):
        for mode in ("curve", "insecure"):
            print(f"  round {rnd + 1}: {mode} ...", flush=True)
            res[mode].append(run(mode, n_tiny, n_big))
    best = {
        m: {"tiny_p50_us": min(r["tiny_p50_us"] for r in rs), "big_GBps": max(r["big_GBps"] for r in rs)}
        for m, rs in res.items()
    }
    c, i = best["curve"], best["insecure"]
    print(f"\nremote path, 1 reader on 127.0.0.1, best of 2 interleaved rounds ({n_tiny} tiny, {n_big} x 4 MiB)")
    print(f"  {'':<26}{'CURVE':>10}{'insecure':>10}{'ratio':>8}")
    print(
        f"  {'tiny round trip p50 (us)':<26}{c['tiny_p50_us']:>10.1f}{i['tiny_p50_us']:>10.1f}"
        f"{c['tiny_p50_us'] / i['tiny_p50_us']:>8.2f}"
    )
    print(
        f"  {'4 MiB throughput (GB/s)':<26}{c['big_GBps']:>10.2f}{i['big_GBps']:>10.2f}"
        f"{i['big_GBps'] / c['big_GBps']:>8.2f}"
    )
    print("  (ratio: how many times slower with CURVE)")


if __name__ == "__main__":
    from rayfree.cli.demo import demo_secret

    with demo_secret():
        main()
