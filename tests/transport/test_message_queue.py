"""MessageQueue with real processes, real shared memory and real sockets.

Behavioural tests run over both reader paths (`path` fixture: "shm" for local
readers through the ring, "tcp" for remote readers over ZeroMQ), the way
dask's test_comms runs one suite over every transport.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from rayfree.transport import (
    HandleError,
    MessageQueue,
    MessageTooLarge,
    QueueClosed,
    QueueShutdown,
    QueueTimeout,
    SegmentNotFound,
    ShmSpaceError,
)
from rayfree.transport.shm import ring
from rayfree.transport.shm.segment import SHM_DIR
from tests.support import children as procs
from tests.support.waits import wait_until

CHUNK = 1 << 16


@pytest.fixture(params=["shm", "tcp"])
def path(request) -> str:
    return request.param


def writer_for(path: str, n: int = 1, **kw) -> MessageQueue:
    kw.setdefault("max_chunk_bytes", CHUNK)
    kw.setdefault("max_chunks", 4)
    return MessageQueue(n, n if path == "shm" else 0, connect_ip="127.0.0.1", **kw)


def handshake(w: MessageQueue, r: MessageQueue) -> None:
    """Both sides of wait_until_ready, the reader's in a thread."""
    t = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 10})
    t.start()
    w.wait_until_ready(timeout=10)
    t.join(10)
    assert not t.is_alive()


def ready_pair(path: str, zero_copy: bool = False, **kw) -> tuple[MessageQueue, MessageQueue]:
    """Writer and reader 0 in this process, handshake done."""
    w = writer_for(path, **kw)
    r = MessageQueue.create_from_handle(w.export_handle(), 0, zero_copy=zero_copy)
    handshake(w, r)
    return w, r


@contextlib.contextmanager
def pair(path: str, **kw) -> Iterator[tuple[MessageQueue, MessageQueue]]:
    w, r = ready_pair(path, **kw)
    try:
        yield w, r
    finally:
        w.close()
        r.close()


def join_all(ps, timeout: float = 60) -> None:
    for p in ps:
        p.join(timeout)
        assert p.exitcode == 0, f"reader process exited with {p.exitcode}"


# -- delivery -------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n_local,fences", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (2, "always")])
def test_every_reader_gets_every_message_once_in_order_bit_exact(n_local: int, fences: str, monkeypatch) -> None:
    """N local readers and one remote reader, 1,000 mixed messages (tiny, chunk-sized,
    4x chunk, tensors of several dtypes, views): each reader's digests equal the writer's.
    fences=always runs the ring with the ordering fences weakly ordered CPUs (aarch64) use."""
    monkeypatch.setenv("RAYFREE_RING_FENCES", fences)
    msgs = procs.mixed_messages(1000, CHUNK, seed=n_local)
    expected = [procs.digest(m) for m in msgs]
    n = n_local + 1
    mq = MessageQueue(n, n_local, max_chunk_bytes=CHUNK, max_chunks=4, connect_ip="127.0.0.1")
    assert mq._w.shm.rw._order == (fences == "always" or not ring._TSO)
    try:
        h = mq.export_handle().to_bytes()
        children = [procs.spawn(procs.reader_digests, h, r, len(msgs)) for r in range(n)]
        mq.wait_until_ready(timeout=120)
        try:
            for m in msgs:
                mq.enqueue(m, timeout=60)
        except QueueTimeout as e:  # say what each reader says (it reports once its own dequeue times out)
            said = [conn.recv() if conn.poll(90) else "nothing" for _, conn in children]
            raise AssertionError(f"{e}\nreaders: {said}") from e
        results = [procs.recv(conn, 180) for _, conn in children]
    finally:
        mq.close()
    join_all([p for p, _ in children])
    for status, rank, where, got in results:
        assert status == "ok", f"reader {rank} failed:\n{where}"
        assert where == ("shm" if rank < n_local else "tcp"), f"reader {rank} took the {where} path"
        assert len(got) == len(expected), f"reader {rank} got {len(got)} messages"
        bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
        assert not bad, f"reader {rank} got wrong content at messages {bad[:10]}"


def test_tensors_arrive_bit_exact_with_dtype_and_shape(path: str) -> None:
    import torch

    with pair(path, max_chunk_bytes=1 << 20) as (w, r):
        for dt in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            for shape in ((), (0,), (3, 5), (1 << 12,), (64, 1024)):
                src = (torch.randn(shape) * 50).to(dt) if dt != torch.bool else torch.randn(shape) > 0
                w.enqueue(src, timeout=10)
                got = r.dequeue(timeout=10)
                assert got.dtype == dt and got.shape == src.shape
                assert procs.digest(got) == procs.digest(src), f"{dt} {shape} differs"
                del got


def test_numpy_bytearray_memoryview_and_big_bytes_round_trip(path: str) -> None:
    np = pytest.importorskip("numpy")
    with pair(path, max_chunk_bytes=1 << 20) as (w, r):
        arr = np.arange(100_000, dtype=np.float32).reshape(100, 1000)
        cases = [
            arr,
            bytearray(b"q" * 70_000),
            memoryview(b"m" * 90_000),
            b"b" * 200_000,
            b"small",
            b"",
            {"nested": [arr[::2], bytearray(10)]},
        ]
        for obj in cases:
            w.enqueue(obj, timeout=10)
            got = r.dequeue(timeout=10)
            assert type(got) is type(obj)
            assert procs.digest(got) == procs.digest(obj)
            del got


def test_small_bytes_skip_pickle_and_arrive_as_bytes(path: str) -> None:
    with pair(path) as (w, r):
        for data in (b"", b"ok", bytes(range(256)) * 15, b"\x80\x05not a pickle", b"\x00RF:READY"):
            w.enqueue(data)  # no timeout: the raw path
            got = r.dequeue(timeout=5)
            assert type(got) is bytes and got == data


def test_message_larger_than_ring_takes_the_overflow_socket_and_arrives(path: str) -> None:
    import torch

    w, r = ready_pair(path)  # ring: 4 x 64 KiB
    try:
        big = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
        w.enqueue(big, timeout=10)
        w.enqueue("after", timeout=10)
        assert torch.equal(r.dequeue(timeout=10), big)
        assert r.dequeue(timeout=10) == "after"
    finally:
        w.close()
        r.close()


def test_every_reader_gets_a_private_writable_tensor(path: str) -> None:
    """vLLM's semantics: two readers of one broadcast each own their tensor; an in-place change by one
    is not seen by the other (TP ranks receive the same inputs)."""
    import torch

    w = writer_for(path, n=2, max_chunk_bytes=1 << 20, max_chunks=8)
    r0 = MessageQueue.create_from_handle(w.export_handle(), 0)
    r1 = MessageQueue.create_from_handle(w.export_handle(), 1)
    try:
        ts = [threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 10}) for r in (r0, r1)]
        for t in ts:
            t.start()
        w.wait_until_ready(timeout=10)
        for t in ts:
            t.join(10)
        src = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
        w.enqueue({"x": src}, timeout=10)
        a, b = r0.dequeue(timeout=10)["x"], r1.dequeue(timeout=10)["x"]
        a += 1
        assert torch.equal(b, src), "reader 1 saw reader 0's in-place change"
        assert torch.equal(a, src + 1)
        assert a.data_ptr() != b.data_ptr()
    finally:
        w.close()
        r0.close()
        r1.close()


@pytest.mark.parametrize("size", [1 << 20, 4 << 20])
def test_a_reader_that_keeps_a_tensor_never_stalls_the_writer(path: str, size: int) -> None:
    """vLLM's test: keep the first message, read 16 more through a ring that comes round several times."""
    import torch

    w, r = ready_pair(path, max_chunk_bytes=size + (1 << 16), max_chunks=4)
    try:
        kept = None
        for i in range(17):
            w.enqueue(torch.full((size,), i % 256, dtype=torch.uint8), timeout=10)
            got = r.dequeue(timeout=10)
            assert int(got[0]) == i % 256 and int(got[-1]) == i % 256
            if i == 0:
                kept = got
        assert kept is not None and bool((kept == 0).all()), "the kept tensor was overwritten"
    finally:
        w.close()
        r.close()


def test_a_big_tensor_is_copied_out_of_the_ring_into_warm_pooled_memory() -> None:
    """The private copy lands in the reader's pool: a buffer the caller has dropped is used again."""
    import gc

    import torch

    w, r = ready_pair("shm", max_chunk_bytes=8 << 20, max_chunks=6)  # 48 MiB ring
    try:
        src = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
        ring, pool = r._r.receiver.ring, r._r.receiver.pool
        for i in range(3):
            w.enqueue(src + i, timeout=10)
            got = r.dequeue(timeout=10)
            assert not ring.address <= got.data_ptr() < ring.address + ring.size, "a view of the ring"
            assert torch.equal(got, src + i)
            del got
            gc.collect()
        assert pool.misses == 1 and pool.hits == 2, (pool.misses, pool.hits)
        w.enqueue(src, timeout=10)
        held = r.dequeue(timeout=10)
        w.enqueue(src + 1, timeout=10)  # the pooled buffer is held: the next copy gets another one
        second = r.dequeue(timeout=10)
        assert torch.equal(held, src) and torch.equal(second, src + 1) and pool.misses == 2
    finally:
        w.close()
        r.close()


def test_zero_copy_readers_get_views_of_the_ring_whose_chunks_wait_for_the_view() -> None:
    """The opt-in: a zero_copy reader's big tensor is a view of the ring, and the writer cannot reuse
    those chunks until the view is gone (it times out naming the reader that holds them)."""
    import gc

    import torch

    w = writer_for("shm", max_chunk_bytes=8 << 20, max_chunks=6)  # 48 MiB ring
    r = MessageQueue.create_from_handle(w.export_handle(), 0, zero_copy=True)
    handshake(w, r)
    try:
        src = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
        w.enqueue(src, timeout=10)
        got = r.dequeue(timeout=10)
        ring = r._r.receiver.ring
        assert ring.address <= got.data_ptr() < ring.address + ring.size, "payload was copied, not viewed"
        assert torch.equal(got, src)
        # 2 x 32 MiB do not fit in 48 MiB: the next one must wait for the view to go
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"rank\(s\) \[0\].*in-place views"):
            w.enqueue(src, timeout=0.3)
        assert time.monotonic() - t0 < 0.6
        assert torch.equal(got, src), "chunks were overwritten while a view was alive"
        del got
        gc.collect()
        w.enqueue(src + 1, timeout=5)
        second = r.dequeue(timeout=10)
        assert torch.equal(second, src + 1)
        del second
        w.enqueue("and the queue goes on", timeout=5)
        assert r.dequeue(timeout=10) == "and the queue goes on"
    finally:
        w.close()
        r.close()


def test_dequeue_timeout_raises_within_twice_the_timeout(path: str) -> None:
    with pair(path) as (w, r):
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout):
            r.dequeue(timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 0.6
        w.enqueue("still works", timeout=5)
        assert r.dequeue(timeout=5) == "still works"


def test_enqueue_on_a_full_ring_times_out_naming_the_reader_that_did_not_read() -> None:
    mq = MessageQueue(2, 2, max_chunk_bytes=CHUNK, max_chunks=4)
    try:
        h = mq.export_handle().to_bytes()
        p0, c0 = procs.spawn(procs.reader_echo, h, 0)
        p1, c1 = procs.spawn(procs.reader_hold, h, 1)
        assert procs.recv(c0)[0] == "attached"
        mq.wait_until_ready(timeout=60)
        assert procs.recv(c1) == "ready"
        for i in range(4):
            mq.enqueue(i, timeout=5)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"rank\(s\) \[1\]"):
            mq.enqueue("one too many", timeout=0.3)
        assert time.monotonic() - t0 < 0.6
        c1.send("go")
        p1.join(30)
    finally:
        mq.close()
    p0.join(30)


def test_wait_until_ready_names_the_reader_that_never_arrived(path: str) -> None:
    w = writer_for(path, n=2)
    r0 = MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"rank\(s\) \[1\]"):
            w.wait_until_ready(timeout=0.5)
        assert time.monotonic() - t0 < 1.0
    finally:
        r0.close()
        w.close()


def test_shutdown_wakes_a_reader_blocked_in_another_thread(path: str) -> None:
    w, r = ready_pair(path)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            r.dequeue(timeout=30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)  # let it park; correctness does not depend on it
    t0 = time.monotonic()
    r.shutdown()
    t.join(5)
    try:
        assert not t.is_alive(), "shutdown() did not wake the blocked reader"
        assert time.monotonic() - t0 < 1.0
        assert len(errors) == 1 and isinstance(errors[0], QueueShutdown), errors
        with pytest.raises(QueueShutdown):
            r.dequeue(timeout=1)
    finally:
        w.close()
        r.close()


@pytest.mark.timeout(60)
def test_a_reader_that_learned_steady_steps_takes_every_message_in_order_and_still_hears_a_shutdown(
    path: str,
) -> None:
    """Messages 5 ms apart teach the reader a rhythm (on shared memory it then naps until a lead before the next
    is due and looks across it, shm/waiting.py; over TCP it waits in ZeroMQ as ever); then one comes at once, one
    later than the rhythm, and a shutdown arrives while it waits: every message arrives once and in order, the
    shutdown ends the wait as a QueueShutdown."""
    w, r = ready_pair(path)
    got: list = []
    errors: list[BaseException] = []
    learned = threading.Event()

    def read() -> None:
        try:
            for _ in range(43):
                got.append(r.dequeue(timeout=30))
                if len(got) == 40:
                    learned.set()
            r.dequeue(timeout=30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(40):
            w.enqueue(i, timeout=5)
            time.sleep(0.005)  # (the rhythm the reader learns; not a synchronisation)
        assert learned.wait(30)
        w.enqueue(40, timeout=5)  # at once
        w.enqueue(41, timeout=5)
        time.sleep(0.05)  # later than the rhythm
        w.enqueue(42, timeout=5)
        wait_until(lambda: len(got) == 43, 30, "every message read")
        r.shutdown()  # the reader waits again, after the same rhythm
        t.join(10)
        assert not t.is_alive()
        assert got == list(range(43)), got
        assert len(errors) == 1 and isinstance(errors[0], QueueShutdown), errors
    finally:
        w.close()
        r.close()


def test_writer_close_ends_a_waiting_reader_with_queue_closed(path: str) -> None:
    w, r = ready_pair(path)
    w.enqueue("last", timeout=5)
    w.close()
    try:
        assert r.dequeue(timeout=5) == "last"
        with pytest.raises(QueueClosed):
            r.dequeue(timeout=5)
    finally:
        r.close()


@pytest.mark.timeout(120)
def test_a_writer_that_exits_right_after_close_loses_nothing_in_flight() -> None:
    # 48 x 1 MiB over CURVE is far more than ZeroMQ's I/O thread sends before the writer's process ends;
    # without the held publisher (lingering.py) the tail and CLOSE were lost and the reader hung.
    n, size = 48, 1 << 20
    p, conn = procs.spawn(procs.writer_burst_then_exit, n, size, env={"RAYFREE_CLOSE_FLUSH_S": "90"})
    r = MessageQueue.create_from_handle(procs.recv(conn), 0)
    try:
        r.wait_until_ready(timeout=60)
        # close() must not wait for this reader, which reads only once close() has returned
        assert procs.recv(conn, timeout=60) == "closed"
        for i in range(n):
            got = r.dequeue(timeout=30)
            assert len(got) == size and got[:4] == i.to_bytes(4, "little"), f"message {i}"
        with pytest.raises(QueueClosed):
            r.dequeue(timeout=30)
    finally:
        r.close()
    p.join(60)
    assert p.exitcode == 0


# -- shared-memory hygiene ---------------------------------------------------------------


def _ours(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_segment_is_unlinked_by_the_handshake_and_nothing_is_left_after_close() -> None:
    w = writer_for("shm")
    name = w.export_handle().shm_name
    assert _ours(name)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    handshake(w, r)
    assert not _ours(name), "segment still named after every reader attached"
    assert not os.path.exists(w.export_handle().ipc_dir), "ipc directory still on disk after the handshake"
    w.enqueue("x", timeout=5)
    assert r.dequeue(timeout=5) == "x"
    w.close()
    r.close()


def test_nothing_is_left_when_the_writer_is_sigkilled_after_the_handshake() -> None:
    p, conn = procs.spawn(procs.writer_then_wait, 1)
    h = procs.recv(conn)
    r = MessageQueue.create_from_handle(h, 0)
    try:
        r.wait_until_ready(timeout=60)
        assert procs.recv(conn) == "sent"
        assert r.dequeue(timeout=10) == "hello"
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        assert not _ours(r.handle.shm_name)
        assert not any(n.startswith(f"rayfree-{p.pid}-") for n in os.listdir(SHM_DIR))
    finally:
        r.close()


def test_nothing_is_left_when_a_reader_is_sigkilled_after_the_handshake() -> None:
    w = writer_for("shm", n=1)
    try:
        p, conn = procs.spawn(procs.reader_echo, w.export_handle().to_bytes(), 0)
        assert procs.recv(conn)[0] == "attached"
        w.wait_until_ready(timeout=60)
        assert procs.recv(conn)[0] == "ready"
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert not _ours(w.export_handle().shm_name)
    finally:
        w.close()


def test_not_enough_shared_memory_says_how_much_is_needed_and_how_to_get_it() -> None:
    with pytest.raises(ShmSpaceError, match=r"needs .* MiB.*shm-size.*ipc"):
        MessageQueue(1, 1, max_chunk_bytes=1 << 30, max_chunks=4096)


# -- bad input ---------------------------------------------------------------------------


def test_corrupt_foreign_and_mismatched_handles_are_refused_clearly(monkeypatch) -> None:
    # The parser's own checks; signed handles (the session has a secret) are tested in test_security.py.
    import msgspec

    monkeypatch.delenv("RAYFREE_SECRET_FILE")
    w = writer_for("shm")
    try:
        good = w.export_handle().to_bytes()
        for bad, why in [
            (good[:3], "truncated"),
            (good[: len(good) // 2], "truncated or corrupt"),
            (b"GARBAGE" * 10, "not a rayfree queue handle"),
            (b"", "truncated"),
        ]:
            with pytest.raises(HandleError, match=why):
                MessageQueue.create_from_handle(bad, 0)
        with pytest.raises(HandleError, match="version"):
            MessageQueue.create_from_handle(msgspec.structs.replace(w.export_handle(), version=99).to_bytes(), 0)
        with pytest.raises(HandleError, match="belongs to queue"):
            MessageQueue.create_from_handle(msgspec.structs.replace(w.export_handle(), queue_id="00" * 16), 0)
        with pytest.raises(HandleError, match="bytes but the handle says"):
            MessageQueue.create_from_handle(msgspec.structs.replace(w.export_handle(), shm_size=4096), 0)
        with pytest.raises(SegmentNotFound, match="another node"):
            MessageQueue.create_from_handle(msgspec.structs.replace(w.export_handle(), shm_name="rayfree-1-00"), 0)
        with pytest.raises(ValueError, match="not a reader"):
            MessageQueue.create_from_handle(good, 7)
        # the queue is still usable after all that
        r = MessageQueue.create_from_handle(good, 0)
        handshake(w, r)
        w.enqueue("ok", timeout=5)
        assert r.dequeue(timeout=5) == "ok"
        r.close()
    finally:
        w.close()


def test_oversized_message_is_refused_and_the_queue_stays_usable(path: str) -> None:
    with pair(path, max_message_bytes=4096) as (w, r):
        with pytest.raises(MessageTooLarge, match="max_message_bytes=4096"):
            w.enqueue(b"x" * 10_000, timeout=5)
        w.enqueue("small", timeout=5)
        assert r.dequeue(timeout=5) == "small"


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="n_reader"):
        MessageQueue(0, 0)
    with pytest.raises(ValueError, match="n_local_reader"):
        MessageQueue(2, 3)
    with pytest.raises(ValueError, match="local_reader_ranks"):
        MessageQueue(3, 2, local_reader_ranks=[0, 0])
    with pytest.raises(ValueError, match="local_reader_ranks"):
        MessageQueue(3, 2, local_reader_ranks=[0, 5])
    with pair("shm") as (w, r):
        with pytest.raises(RuntimeError, match="only the queue's writer"):
            r.enqueue("x")
        with pytest.raises(RuntimeError, match="writer cannot dequeue"):
            w.dequeue()


def test_use_before_handshake_is_refused() -> None:
    w = writer_for("shm")
    try:
        with pytest.raises(RuntimeError, match="wait_until_ready"):
            w.enqueue("too early")
    finally:
        w.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not procs.CAN_CUT_TCP, reason="cutting a TCP connection takes root and ss")
def test_a_remote_reader_whose_link_drops_raises_queue_broken_instead_of_waiting_forever() -> None:
    """`ss -K` cuts the reader's TCP connection to the writer, as a network fault would. ZeroMQ reconnects, but
    what was sent meanwhile is lost and the writer does not take the reader back; the reader says so with
    QueueBroken once RAYFREE_LINK_GRACE_S (1 s here) has passed, instead of waiting out its 60 s timeout."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    p, conn = procs.spawn(procs.reader_echo, w.export_handle().to_bytes(), 0, env={"RAYFREE_LINK_GRACE_S": "1"})
    try:
        assert procs.recv(conn)[0] == "attached"
        w.wait_until_ready(timeout=60)
        assert procs.recv(conn)[0] == "ready"
        w.enqueue("before", timeout=10)
        assert procs.recv(conn) == ("msg", procs.digest("before"))
        port = w.export_handle().remote_endpoint.rsplit(":", 1)[1]
        procs.cut_tcp(port)
        t0 = time.monotonic()
        w.enqueue("after", timeout=10)  # to no one: the reconnected reader is not admitted again
        kind, detail = procs.recv(conn, timeout=30)
        took = time.monotonic() - t0
    finally:
        w.close(flush_timeout=0)
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)
    assert kind == "error" and "QueueBroken" in detail and "dropped" in detail, detail
    assert took < 15, took


def test_ipv6_remote_reader() -> None:
    w = MessageQueue(1, 0, connect_ip="::1")
    assert w.export_handle().remote_endpoint.startswith("tcp://[::1]:")
    r = MessageQueue.create_from_handle(w.export_handle().to_bytes(), 0)
    handshake(w, r)
    try:
        w.enqueue({"v6": True}, timeout=5)
        assert r.dequeue(timeout=5) == {"v6": True}
    finally:
        w.close()
        r.close()


def test_reader_waits_past_a_wrap_marker_until_the_message_behind_it_is_written() -> None:
    """The writer wraps while a zero-copy reader still holds chunk 0: the parked reader is woken by
    the WRAP marker, goes past it, waits again, and gets the message once it lets go of
    the old view."""
    import gc

    import torch

    with pair("shm", zero_copy=True, max_chunk_bytes=1 << 20, max_chunks=4) as (w, r):
        a = torch.full((2 << 20,), 7, dtype=torch.uint8)  # 3 chunks: 0..2
        w.enqueue(a, timeout=5)
        held = r.dequeue(timeout=5)
        b = torch.full((2 << 20,), 9, dtype=torch.uint8)  # needs 0..2 again, after a WRAP at 3
        results: dict[str, object] = {}
        tw = threading.Thread(target=lambda: results.setdefault("w", w.enqueue(b, timeout=10)))
        tr = threading.Thread(target=lambda: results.setdefault("r", r.dequeue(timeout=10)))
        tr.start()
        wait_until(lambda: r._r.receiver.ring.buf[128] == 1, 10, "the reader parked at chunk 3", every=0.001)
        tw.start()
        # woken by the WRAP marker, it went past it to chunk 0
        wait_until(lambda: r._r.receiver.rr.idx == 0, 10, "the reader past the marker", every=0.001)
        assert torch.equal(held, a)
        del held
        gc.collect()
        tw.join(10)
        tr.join(10)
        assert not tw.is_alive() and not tr.is_alive()
        assert torch.equal(results["r"], b)
        results.clear()  # drop the view before the queue closes


def test_a_writer_waiting_for_a_wrap_marker_to_be_read_is_woken() -> None:
    """The WRAP marker sits inside the run the writer needs: the reader that consumes it
    must wake the parked writer (it did not, once: the writer slept until its timeout)."""
    with pair("shm") as (w, r):  # 4 chunks of 64 KiB
        w.enqueue(b"a" * (150 << 10), timeout=5)  # chunks 0..2
        assert r.dequeue(timeout=5) == b"a" * (150 << 10)
        got: list = []
        t = threading.Thread(target=lambda: got.append(r.dequeue(timeout=10)))
        t.start()
        wait_until(lambda: r._r.receiver.ring.buf[128] == 1, 10, "the reader parked at chunk 3", every=0.001)
        t0 = time.monotonic()
        w.enqueue(b"b" * (250 << 10), timeout=5)  # 4 chunks: WRAP at 3, then 0..3
        assert time.monotonic() - t0 < 2.0, "the writer was not woken when its chunk came free"
        t.join(10)
        assert got == [b"b" * (250 << 10)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [0, 0.0, -1.0])
def test_a_read_with_no_time_left_still_takes_a_message_that_has_arrived(path: str, timeout: float) -> None:
    """vLLM's readers poll with timeout 0: a message already there is read, on the socket path as on shm."""
    with pair(path) as (w, r):
        with pytest.raises(QueueTimeout):
            r.dequeue(timeout=timeout)  # nothing there yet
        w.enqueue({"n": 1})
        deadline = time.monotonic() + 10
        while True:  # it has arrived once the reader can see it; bounded by the deadline
            try:
                got = r.dequeue(timeout=timeout)
                break
            except QueueTimeout:
                assert time.monotonic() < deadline, "the message never became readable with timeout 0"
                time.sleep(0.01)
        assert got == {"n": 1}
