"""Every message of an insecure TCP stream carries its sequence number: a lost, repeated or reordered message is
`OutOfSequence` naming the stream and both numbers, never a skip or a hang (a sealed stream's sequence numbers
are in its sealed header, tests/transport/test_security.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from rayfree import OutOfSequence, QueueBroken
from rayfree.transport import MessageQueue
from rayfree.transport.secure import policy as security


@contextlib.contextmanager
def insecure_pair() -> Iterator[tuple[MessageQueue, MessageQueue, object]]:
    security.use(security.Policy(None, True))
    try:
        w = MessageQueue(1, 0, connect_ip="127.0.0.1", max_chunk_bytes=1 << 16, max_chunks=8)
        r = MessageQueue.create_from_handle(w.export_handle(), 0)
        t = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 10})
        t.start()
        w.wait_until_ready(timeout=10)
        t.join(10)
        stream = w._w.remote  # the writer's TCP sender: the test plays the network that loses a message
        assert stream is not None and stream.sealer is None
        try:
            yield w, r, stream
        finally:
            w.close()
            r.close()
    finally:
        security.use(None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shift, said", [(1, r"message 3 arrived where 2 was due \(1 lost\)"), (-1, "message 1 arrived where 2 was due")]
)
def test_a_lost_or_repeated_message_is_an_error_naming_the_stream_and_both_numbers(shift: int, said: str) -> None:
    with insecure_pair() as (w, r, stream):
        w.enqueue("a", timeout=5)
        assert r.dequeue(timeout=5) == "a"
        stream.seq += shift  # as if message 2 was lost (or message 1 came again)
        w.enqueue(("b", b"x" * 100_000), timeout=5)  # a multi-frame message: the number is in frame 0 too
        with pytest.raises(OutOfSequence, match=said) as e:
            r.dequeue(timeout=5)
    assert isinstance(e.value, QueueBroken) and "tcp stream from tcp://127.0.0.1:" in str(e.value)
    assert ("repeated or reordered" in str(e.value)) == (shift < 0)


@pytest.mark.timeout(60)
def test_messages_in_order_go_through_and_the_wire_carries_eight_bytes_more() -> None:
    with insecure_pair() as (w, r, stream):
        for i in range(50):
            w.enqueue(i if i % 2 else bytes([i]) * 10, timeout=5)
        got = [r.dequeue(timeout=5) for _ in range(50)]
        assert got == [i if i % 2 else bytes([i]) * 10 for i in range(50)]
        assert stream.seq == 51  # READY, then 50 messages
