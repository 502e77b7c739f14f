"""Ranks for tests/transport/test_vllm_queue.py: vLLM's own MessageQueue scenarios, run against rayfree's queue."""

from __future__ import annotations

import os
import random
import threading
import time
import traceback

import numpy as np


def get_arrays(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, int(k)) for k in rng.integers(1, 10_000, n)]


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def broadcast(rank: int, world: int, port: int, n: int, conn) -> None:
    """vLLM's test_shm_broadcast: writer rank 2 broadcasts n random arrays with random pauses."""
    try:
        import torch.distributed as dist

        from rayfree import MessageQueue

        _join(rank, world, port)
        writer_rank = 2
        mq = MessageQueue.create_from_process_group(dist.group.WORLD, 40 * 1024, 2, writer_rank)
        seed = [random.randint(0, 1000) if rank == writer_rank else None]
        dist.broadcast_object_list(seed, writer_rank)
        dist.barrier()
        arrays = get_arrays(n, seed[0])
        bad = 0
        for x in arrays:
            if rank == writer_rank:
                mq.broadcast_object(x)
            else:
                y = mq.broadcast_object(None)
                bad += int(not np.array_equal(x, y))
            time.sleep(random.random() / 5000)
        dist.barrier()
        path = "writer" if mq.is_writer else ("shm" if mq.is_local_reader else "tcp")
        mq.close()
        conn.send(("ok", rank, bad, path))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", rank, traceback.format_exc(), None))


def cancel(rank: int, world: int, port: int, n: int, conn) -> None:
    """vLLM's test_message_queue_shutdown: an idle reader's dequeue times out, then shutdown() from another
    thread ends a blocked dequeue, and `shutting_down` says so."""
    try:
        import torch.distributed as dist

        from rayfree import MessageQueue, QueueShutdown

        _join(rank, world, port)
        writer_rank = 2
        mq = MessageQueue.create_from_process_group(dist.group.WORLD, 40 * 1024, 2, writer_rank)
        dist.barrier()
        result = {}
        if rank != writer_rank:
            t0 = time.monotonic()
            try:
                mq.dequeue(timeout=0.001)
                result["timeout"] = "no TimeoutError"
            except TimeoutError:
                result["timeout"] = time.monotonic() - t0
            go = threading.Event()
            threading.Thread(target=lambda: (go.wait(10), mq.shutdown())).start()
            go.set()
            t0 = time.monotonic()
            try:
                mq.dequeue(timeout=5)
                result["shutdown"] = "returned"
            except QueueShutdown as e:
                result["shutdown"] = (time.monotonic() - t0, isinstance(e, RuntimeError))
            result["shutting_down"] = mq.shutting_down
        else:
            mq.shutdown()
            result["shutting_down"] = mq.shutting_down
        dist.barrier()
        mq.close()
        conn.send(("ok", rank, result, None))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", rank, traceback.format_exc(), None))


def single_reader(rank: int, world: int, port: int, n: int, conn) -> None:
    """create_from_process_group_single_reader: every rank writes to rank 0, which gets every handle."""
    try:
        import torch.distributed as dist

        from rayfree import MessageQueue

        _join(rank, world, port)
        mq, handles = MessageQueue.create_from_process_group_single_reader(dist.group.WORLD, 1 << 16, 4, 0)
        readers = []
        if rank == 0:
            readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
        got = []
        ts = [threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 30}) for r in readers]
        for t in ts:
            t.start()
        mq.wait_until_ready(timeout=30)
        for t in ts:
            t.join(30)
        mq.enqueue(("from", rank))
        got = [r.dequeue(timeout=30) for r in readers]
        dist.barrier()
        for r in readers:
            r.close()
        mq.close()
        conn.send(("ok", rank, (len(handles), got), None))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", rank, traceback.format_exc(), None))
