"""A follower that serves on without node 0 (executor/follower_liveness.py): its heartbeats go on, `alone`, so
whoever answers at node 0's address again knows at once that it will not come back. Real sockets on loopback,
the real HeartbeatServer and HeartbeatClient, no mocks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.transport import get_open_port
from rayfree.transport.zmq.sockets import SocketError
from tests.support.waits import wait_until


def _node_0(
    port: int, lost: list, armed: bool, on_alone: Callable[[int, str], object] | None = None
) -> HeartbeatServer:
    """Node 0 at `port`: bound again as soon as ZeroMQ has let the port go (it closes an earlier socket in its
    own I/O thread, after the close returned)."""
    made: list[HeartbeatServer] = []

    def bound() -> bool:
        try:
            made.append(
                HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 5.0, lambda n, r, ip, why: lost.append((n, why)))
            )
        except SocketError:
            return False
        return True

    wait_until(bound, 20, f"port {port} free to bind again", every=0.05)
    server = made[0]
    server.on_alone = on_alone  # type: ignore[assignment]
    server.start()
    if armed:
        server.arm()
    return server


@pytest.mark.timeout(90)
def test_a_follower_that_serves_on_without_node_0_tells_each_node_0_that_answers_after() -> None:
    """Node 0 goes without a goodbye; the follower, whose layer above serves on (its `on_lost` says True), beats
    on `alone` and ends no thread. A node 0 started again (not armed: it starts) hears it, with why, to refuse
    to start; one running (armed: a cut healed, a stop resumed) counts that follower
    lost at once, naming why. Neither's answers reach the follower's layer above."""
    port = get_open_port("127.0.0.1")
    gone: list[str] = []
    byes: list[tuple] = []
    client = HeartbeatClient(
        "127.0.0.1", port, 1, [1], "127.0.0.1", 0.05, 5.0, lambda why: gone.append(why) or True,
        lambda node, clean, why: byes.append((node, clean, why)),
    )  # fmt: skip
    first: list = []
    node_0 = _node_0(port, first, armed=True)
    client.start()
    try:
        assert client.contact.wait(20), "the follower never heard node 0"
        client.arm()
        node_0.close(None, timeout=10)  # (no goodbye: as if killed)
        wait_until(lambda: bool(client.alone), 20, "the follower serving on without node 0")
        assert len(gone) == 1 and client.alone == gone[0] and client.running(), (gone, client.alone)

        heard: list[tuple[int, str]] = []
        told = threading.Event()
        again = _node_0(port, first, armed=False, on_alone=lambda node, why: (heard.append((node, why)), told.set()))
        try:
            assert told.wait(20), "node 0 started again never heard that node 1 serves without it"
        finally:
            again.close(None, timeout=10)
        assert heard == [(1, client.alone)], heard
        assert not first, first  # (it starts: nobody is lost)

        lost: list[tuple[int, str]] = []
        running = _node_0(port, lost, armed=True)
        try:
            wait_until(lambda: bool(lost), 20, "node 0 running counting the follower that serves alone lost")
        finally:
            running.close(None, timeout=10)
        assert lost == [(1, f"it serves on without node 0, which it lost ({client.alone})")], lost
        assert len(gone) == 1 and not byes and client.running(), (gone, byes)
    finally:
        client.close(timeout=10)
