"""vLLM's own MessageQueue tests (tests/distributed/test_shm_broadcast.py), rewritten against rayfree's queue:
an engine switches by changing an import, so the same scenarios must hold."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import zmq

from rayfree import MessageQueue, SocketError
from rayfree.transport import get_open_port
from tests.support import vllm_style

CTX = mp.get_context("spawn")
WORLD = 4


def run(target, n: int = 0) -> dict[int, tuple]:
    port = get_open_port("127.0.0.1")
    conns, procs = [], []
    for rank in range(WORLD):
        a, b = CTX.Pipe()
        p = CTX.Process(target=target, args=(rank, WORLD, port, n, b), daemon=True)
        p.start()
        procs.append(p)
        conns.append(a)
    out = {}
    for rank, c in enumerate(conns):
        assert c.poll(150), f"rank {rank} said nothing"
        status, r, value, extra = c.recv()
        assert status == "ok", f"rank {r} failed:\n{value}"
        out[r] = (value, extra)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, p.exitcode
    return out


@pytest.mark.timeout(180)
def test_broadcast_over_a_torch_process_group_delivers_every_array() -> None:
    res = run(vllm_style.broadcast, 1000)
    assert {r: v[0] for r, v in res.items() if r != 2} == {0: 0, 1: 0, 3: 0}, res
    assert res[2][1] == "writer" and all(res[r][1] == "shm" for r in (0, 1, 3))


@pytest.mark.timeout(180)
def test_an_idle_reader_times_out_and_shutdown_from_another_thread_ends_its_wait() -> None:
    res = run(vllm_style.cancel)
    for rank, (r, _) in res.items():
        assert r["shutting_down"] is True
        if rank != 2:
            assert isinstance(r["timeout"], float) and r["timeout"] < 1.0, r
            took, is_runtime_error = r["shutdown"]
            assert took < 2.0 and is_runtime_error, r


@pytest.mark.timeout(180)
def test_single_reader_queues_gather_every_handle_on_the_reader() -> None:
    res = run(vllm_style.single_reader)
    n_handles, got = res[0][0]
    assert n_handles == WORLD and got == [("from", r) for r in range(WORLD)]
    assert all(res[r][0] == (0, []) for r in range(1, WORLD))


def test_a_negative_timeout_counts_as_zero_and_a_failed_bind_is_a_zmq_error() -> None:
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        import threading

        t = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 10})
        t.start()
        w.wait_until_ready(timeout=10)
        t.join(10)
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=-1)
        w.enqueue("x", timeout=-1)
        assert r.dequeue(timeout=-5) == "x"
    finally:
        w.close()
        r.close()
    with pytest.raises(zmq.ZMQError) as info:  # an address of no interface here: binding fails
        MessageQueue(1, 0, connect_ip="192.0.2.123")
    assert isinstance(info.value, SocketError) and info.value.errno == zmq.EADDRNOTAVAIL
    h = MessageQueue(1, 0, connect_ip="127.0.0.1")
    try:
        assert h.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    finally:
        h.close()
