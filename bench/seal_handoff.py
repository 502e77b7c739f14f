"""How a sealed segment is handed to ZeroMQ: what the writer's process spends per 4 MiB message, four 1 MiB
segments each sealed on its own (AES-256-GCM, `encrypt_into`) and sent to a reader in another process over TCP
loopback, by three hand-offs:

- tracked: sealed into a reused buffer, sent as a zero-copy pyzmq Frame with a tracker (transport/zmq/sender.py:
  a Frame, an Event and a MessageTracker per segment, and a trip through pyzmq's garbage-collector thread when
  ZeroMQ lets go);
- owned: sealed straight into a message ZeroMQ owns (a pyzmq Frame made with copy=True, whose buffer is writable;
  nothing to track or give back, but the Frame's making fills it, a copy);
- copied: sealed into one reused buffer, then sent with copy=True (ZeroMQ copies it).

Beside them, the seal alone (no send), and the same bytes sent unsealed (insecure: zero-copy, tracked), so the
sealed hand-offs' extra over insecure reads against the seal's own cost. CPU is the writer process's, every
thread (its I/O thread's TCP send included), from getrusage; rounds alternate the hand-offs, so a slow spell
hits each alike.

    python bench/seal_handoff.py [--rounds 3] [--messages 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import struct
import sys
import time

import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEG = 1 << 20
SEGMENTS = 4
HEAD = 16  # (room for a segment's head, as the sealer leaves)
TAG = 16
_nonce = struct.Struct("<Q4x").pack


def _reader(port: int, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(count):
        sock.recv(copy=False)
    sock.close()
    ctx.term()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(mode: str, messages: int) -> tuple[float, float]:
    """(writer CPU us, wall us) per 4 MiB message for one hand-off."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sends = 0 if mode == "seal only" else messages * SEGMENTS
    reader = mp.get_context("spawn").Process(target=_reader, args=(port, sends), daemon=True)
    reader.start()
    aead, data = AESGCM(os.urandom(32)), os.urandom(SEG)
    size = HEAD + SEG + TAG
    pool = [memoryview(bytearray(size)) for _ in range(16)]
    zeros = memoryview(bytearray(size))
    trackers: list[zmq.MessageTracker] = []
    seq = 0
    c0, t0 = _cpu(), time.perf_counter()
    for _ in range(messages):
        for _ in range(SEGMENTS):
            seq += 1
            if mode == "tracked":
                buf = pool[seq % len(pool)]
                aead.encrypt_into(_nonce(seq), data, b"head", buf[HEAD:])
                frame = zmq.Frame(buf, track=True)
                sock.send(frame, copy=False)
                trackers.append(frame.tracker)
                if len(trackers) > len(pool) - 4:  # (a buffer is reused once ZeroMQ let go of it)
                    trackers.pop(0).wait(60)
            elif mode == "owned":
                frame = zmq.Frame(zeros, copy=True)
                aead.encrypt_into(_nonce(seq), data, b"head", memoryview(frame)[HEAD:])
                sock.send(frame, copy=False)
            elif mode == "insecure":
                frame = zmq.Frame(data, track=True)
                sock.send(frame, copy=False)
                trackers.append(frame.tracker)
                if len(trackers) > len(pool) - 4:
                    trackers.pop(0).wait(60)
            elif mode == "copied":
                buf = pool[0]
                aead.encrypt_into(_nonce(seq), data, b"head", buf[HEAD:])
                sock.send(buf, copy=True)
            else:
                aead.encrypt_into(_nonce(seq), data, b"head", pool[0][HEAD:])
    reader.join(120)
    cpu, wall = _cpu() - c0, time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    return cpu / messages * 1e6, wall / messages * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--messages", type=int, default=300)
    args = ap.parse_args()
    modes = ["seal only", "insecure", "tracked", "owned", "copied"]
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            got[m].append(run(m, args.messages))
    print(f"sealed 4 MiB (4 x 1 MiB segments) to one reader over TCP loopback, {os.cpu_count()} cores, "
          f"{args.rounds} rounds; the writer process's CPU and wall per message, us (median; spread)")  # fmt: skip
    seal = statistics.median(c for c, _ in got["seal only"])
    insecure = statistics.median(c for c, _ in got["insecure"])
    for m in modes:
        cpu, wall = [c for c, _ in got[m]], [w for _, w in got[m]]
        over = (statistics.median(cpu) - insecure) / seal
        extra = "" if m in ("seal only", "insecure") else f", over insecure {over:4.2f}x the seal"
        print(f"{m:>10}: cpu {statistics.median(cpu):7.0f} ({min(cpu):.0f}-{max(cpu):.0f}){extra}; "
              f"wall {statistics.median(wall):7.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
