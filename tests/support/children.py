"""Reader processes for the tests (module-level so 'spawn' can import them) and message helpers."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import traceback
from typing import Any

CTX = mp.get_context("spawn")
STOP = "__stop__"


def digest(obj: Any) -> str:
    """A canonical fingerprint: tensors by dtype, shape and raw bytes; the rest by repr."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            import ctypes

            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        h.update(f"B{type(obj).__name__}{len(obj)}".encode())
        h.update(bytes(obj))
    elif isinstance(obj, dict):
        h.update(b"D")
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{type(obj).__name__}{len(obj)}".encode())
        for x in obj:
            _feed(h, x)
    elif type(obj).__module__ == "numpy":
        h.update(f"N{obj.dtype}{obj.shape}".encode())
        h.update(obj.tobytes())
    else:
        h.update(repr(obj).encode())


def mixed_messages(n: int, chunk: int, seed: int = 0) -> list[Any]:
    """Tiny, chunk-sized, 4x-chunk and tensor messages of several dtypes, deterministic."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.float64,
        torch.int8,
    ]
    out: list[Any] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(("tiny", i, {"k": i * 3}))
        elif kind == 1:
            out.append(bytearray((i % 251,)) * (chunk - 512))  # about one chunk
        elif kind == 2:
            out.append(bytes((i * 7) % 256 for _ in range(16)) * (chunk // 4))  # 4x a chunk
        elif kind == 3:
            dt = dtypes[i % len(dtypes)]
            t = torch.randn(37, 11, generator=g) * 100
            out.append(t.to(dt) if dt != torch.bool else t > 0)
        elif kind == 4:
            dt = dtypes[(i // 6) % len(dtypes)]
            t = (
                torch.randn(chunk // 16, generator=g).to(dt)
                if dt != torch.bool
                else torch.randn(chunk // 16, generator=g) > 0
            )
            out.append({"step": i, "x": t, "view": t[::2]})  # a non-contiguous view too
        else:
            out.append([i, "s" * (i % 50), None, 1.5, torch.tensor(i)])
    return out


def reader_digests(handle: bytes, rank: int, n: int, conn, timeout: float = 60.0, spin_us=None) -> None:
    """Attach as `rank`, read `n` messages, send back (rank, path, digests) or an error."""
    import faulthandler
    import sys

    from rayfree.transport import MessageQueue

    got: list[str] = []
    try:
        mq = MessageQueue.create_from_handle(handle, rank, spin_us=spin_us)
        with mq:
            mq.wait_until_ready(timeout=timeout)
            path = "shm" if mq.is_local_reader else "tcp"
            for _ in range(n):
                # stuck this long on one message: print where (to the test's captured stderr)
                faulthandler.dump_traceback_later(timeout * 0.8, file=sys.stderr)
                got.append(digest(mq.dequeue(timeout=timeout)))
            faulthandler.cancel_dump_traceback_later()
        conn.send(("ok", rank, path, got))
    except BaseException:
        conn.send(("error", rank, f"after {len(got)} messages:\n{traceback.format_exc()}", None))


def reader_echo(handle: bytes, rank: int, conn, timeout: float = 60.0) -> None:
    """Attach, report ready, then forward every message's digest until STOP (or until killed)."""
    from rayfree.transport import MessageQueue

    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        conn.send(("attached", os.getpid()))
        mq.wait_until_ready(timeout=timeout)
        conn.send(("ready", os.getpid()))
        while True:
            m = mq.dequeue(timeout=timeout)
            if isinstance(m, str) and m == STOP:
                break
            conn.send(("msg", digest(m)))
        mq.close()
        conn.send(("done", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def reader_hold(handle: bytes, rank: int, conn, timeout: float = 60.0) -> None:
    """Attach and handshake, then never read: a stuck reader."""
    from rayfree.transport import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=timeout)
    conn.send("ready")
    conn.recv()  # until the test says so
    mq.close()


def writer_then_wait(n_reader: int, conn, chunk: int = 1 << 16) -> None:
    """A writer in its own process: make a queue, hand out the handle, handshake, send, wait to be killed."""
    from rayfree.transport import MessageQueue

    mq = MessageQueue(n_reader, n_reader, max_chunk_bytes=chunk, max_chunks=4)
    conn.send(mq.export_handle().to_bytes())
    mq.wait_until_ready(timeout=60)
    mq.enqueue("hello")
    conn.send("sent")
    signal.pause()


def writer_burst_then_exit(n_msgs: int, size: int, conn) -> None:
    """A writer with one remote reader: enqueue a backlog, close, and let the process end at once."""
    from rayfree.transport import MessageQueue

    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    conn.send(mq.export_handle().to_bytes())
    mq.wait_until_ready(timeout=60)
    for i in range(n_msgs):
        mq.enqueue(bytearray(i.to_bytes(4, "little")) * (size // 4), timeout=60)
    mq.close()
    conn.send("closed")


def reader_collect(handle: bytes, rank: int, n: int, conn, timeout: float = 60.0) -> None:
    """Attach, read `n` messages, send back ("done", messages, how many bad frames were skipped)."""
    from rayfree.transport import MessageQueue

    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        conn.send(("attached", os.getpid()))
        with mq:
            mq.wait_until_ready(timeout=timeout)
            got = [mq.dequeue(timeout=timeout) for _ in range(n)]
            conn.send(("done", got, mq._r.bad_frames))
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))


def spawn(target, *args, env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """Start `target(*args, child_conn)` in a spawned process (with `env` added to its environment);
    return (process, parent_conn)."""
    parent, child = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, child), daemon=True)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        p.start()  # spawn copies the environment now
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    child.close()
    return p, parent


def recv(conn, timeout: float = 60.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child within {timeout}s")
    return conn.recv()


#: `cut_tcp` needs root and iproute2's ss (with the kernel's socket-destroy support)
CAN_CUT_TCP = os.geteuid() == 0 and shutil.which("ss") is not None


def cut_tcp(port: str | int) -> None:
    """Abort every loopback TCP connection to `port` (`ss -K`), as a network fault would: the connecting side
    gets an error and ZeroMQ reconnects."""
    cut = subprocess.run(
        ["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], capture_output=True, text=True, timeout=10
    )
    assert cut.returncode == 0 and f":{port}" in cut.stdout, (cut.stdout, cut.stderr)
