"""A follower that serves on without node 0 (executor/follower_liveness.py): its heartbeats go on, `alone`, so
whoever answers at node 0's address again knows at once that it will not come back. Real sockets on loopback,
the real HeartbeatServer and HeartbeatClient, no mocks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.cluster.heartbeat_messages import Beat, Bye, Resumed, _encode
from rayfree.transport import get_open_port
from rayfree.transport.zmq.sockets import SocketError
from tests.support.waits import wait_until


def _node_0(
    port: int, lost: list, armed: bool, on_alone: Callable[[int, Beat], object] | None = None
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


def _alone_follower(port: int, gone: list[str], byes: list[tuple]) -> HeartbeatClient:
    """A follower of a node 0 at `port` that goes without a goodbye (as if killed): its layer above serves on (its
    `on_lost` says True), so it beats on `alone`. Returned started, alone; the caller closes it."""
    client = HeartbeatClient(
        "127.0.0.1", port, 1, [1], "127.0.0.1", 0.05, 5.0, lambda why: gone.append(why) or True,
        lambda node, clean, why: byes.append((node, clean, why)),
    )  # fmt: skip
    client.alone_epochs = {0: 0, 1: 2}  # (what the layer above sets as it goes alone)
    node_0 = _node_0(port, [], armed=True)
    client.start()
    try:
        assert client.contact.wait(20), "the follower never heard node 0"
        client.arm()
        node_0.close(None, timeout=10)  # (no goodbye: as if killed)
        wait_until(lambda: bool(client.alone), 20, "the follower serving on without node 0")
    except BaseException:
        client.close(timeout=10)
        raise
    return client


@pytest.mark.timeout(90)
def test_a_follower_that_serves_on_without_node_0_tells_each_node_0_that_answers_after() -> None:
    """Node 0 goes without a goodbye; the follower, whose layer above serves on (its `on_lost` says True), beats
    on `alone` and ends no thread. A node 0 started again (not armed: it starts) hears it, with why, to resume
    the cluster from it; one running (armed: a cut healed, a stop resumed) counts that follower
    lost at once, naming why. Neither's answers reach the follower's layer above."""
    port = get_open_port("127.0.0.1")
    gone: list[str] = []
    byes: list[tuple] = []
    first: list = []
    client = _alone_follower(port, gone, byes)
    try:
        assert len(gone) == 1 and client.alone == gone[0] and client.running(), (gone, client.alone)

        heard: list[tuple[int, str]] = []
        told = threading.Event()
        again = _node_0(
            port, first, armed=False, on_alone=lambda node, beat: (heard.append((node, beat.alone)), told.set())
        )
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


@pytest.mark.timeout(90)
def test_a_node_0_started_again_takes_a_follower_serving_without_it_back() -> None:
    """The follower serves alone, its beats carrying its epochs. A node 0 started again hears them while it starts
    (`on_alone`, with the epochs); once armed, its `adopt` answers the next alone beat with a Resumed: the
    follower's layer above hears it (`on_resumed`), it beats as a follower again (not alone), node 0 counts it
    alive (no loss), and node 0's goodbye reaches it as before it lost node 0."""
    port = get_open_port("127.0.0.1")
    gone: list[str] = []
    byes: list[tuple] = []
    resumed: list[Resumed] = []
    client = _alone_follower(port, gone, byes)
    client.on_resumed = resumed.append
    try:
        heard: list[Beat] = []
        lost: list = []
        again = _node_0(port, lost, armed=False, on_alone=lambda node, beat: heard.append(beat))
        again.adopt = lambda node, beat: _encode(Resumed({0: 1, 1: 2}))
        try:
            wait_until(lambda: bool(heard), 20, "node 0 started again hearing the follower that serves alone")
            assert heard[0].epochs == {0: 0, 1: 2} and heard[0].alone == gone[0], heard[0]
            again.arm()  # (its own replicas serve)
            wait_until(lambda: bool(resumed), 20, "the follower taken back")
            assert resumed[0].epochs == {0: 1, 1: 2} and client.alone == "" and client.armed_at is not None
            peer = again.peers[1]
            taken = peer.last_seen
            assert taken is not None
            wait_until(lambda: (peer.last_seen or 0.0) > taken, 20, "node 0 hearing it beat as a follower again")
            assert not peer.gone and not lost, (peer.gone, lost)
        finally:
            again.close(Bye(0, True, "done"), timeout=10)
        wait_until(lambda: bool(byes), 20, "node 0's goodbye reaching the follower it took back")
        assert byes == [(0, True, "done")] and len(gone) == 1 and len(resumed) >= 1, (byes, gone)
    finally:
        client.close(timeout=10)
