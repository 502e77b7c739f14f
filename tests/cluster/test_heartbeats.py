"""Node 0's goodbye, end to end: a follower has read it before node 0's heartbeat thread lets its process go on
to exit (ZeroMQ drops what its I/O thread has not sent when a process exits), and a follower that never reads
it holds node 0 up only for a bounded, logged wait. Real sockets on loopback, no mocks."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time

import msgspec
import pytest
import zmq

from rayfree.cluster.heartbeat import Beat, Bye, HeartbeatServer
from rayfree.cluster.heartbeat_client import HeartbeatClient
from rayfree.cluster.heartbeat_messages import _decode, _encode
from rayfree.cluster.heartbeat_peer import BYE_CONFIRM_S
from rayfree.transport import get_open_port
from rayfree.transport.zmq.sockets import make_dealer
from tests.support.waits import wait_until


def _server(port: int, lost: list[int]) -> HeartbeatServer:
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 5.0, lambda n, r, ip, why: lost.append(n))
    server.start()
    return server


def _follower(port: int) -> zmq.Socket:
    """A raw follower that beat once and was answered: node 0 knows its connection."""
    sock = make_dealer(f"tcp://127.0.0.1:{port}")
    sock.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), 1)))
    assert sock.poll(20_000), "node 0 never answered the beat"
    return sock


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clean", [True, False])
def test_a_follower_has_read_node_0s_goodbye_when_node_0s_close_returns(clean: bool) -> None:
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    byes: list[tuple[int, bool, str]] = []
    told = threading.Event()
    server = _server(port, lost)
    client = HeartbeatClient(
        "127.0.0.1",
        port,
        1,
        [1],
        "127.0.0.1",
        0.05,
        5.0,
        lambda why: lost.append(0),
        lambda node, c, reason: (byes.append((node, c, reason)), told.set()),
    )
    client.start()
    try:
        assert client.contact.wait(20), "the follower never heard node 0"
        server.close(Bye(0, clean, "shut down"), timeout=20)
        # No wait here: node 0's close returned, so its process may exit now, and the follower has it already.
        assert told.is_set() and byes == [(0, clean, "shut down")], byes
        assert client.join(10)
        assert not lost, lost
    finally:
        client.close(timeout=10)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_a_follower_that_never_reads_the_goodbye_holds_node_0_up_only_for_a_bounded_logged_wait(caplog) -> None:
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = _server(port, lost)
    deaf = _follower(port)
    try:
        with caplog.at_level(logging.WARNING, logger="rayfree.cluster"):
            server.close(Bye(0, True, "shut down"), timeout=BYE_CONFIRM_S + 20)
            assert not server.running()
        warned = [r.getMessage() for r in caplog.records if "did not close their connection" in r.getMessage()]
        assert warned and "[1]" in warned[0] and "leaving anyway" in warned[0], caplog.text
    finally:
        deaf.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_node_0s_close_waits_for_the_follower_that_read_the_goodbye_to_drop_its_connection(caplog) -> None:
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = _server(port, lost)
    follower = _follower(port)
    closer = threading.Thread(target=server.close, args=(Bye(0, True, "shut down"), BYE_CONFIRM_S + 20))
    try:
        with caplog.at_level(logging.WARNING, logger="rayfree.cluster"):
            closer.start()
            got = None
            while not isinstance(got, Bye):  # answers and verdicts may come first
                assert follower.poll(20_000), "no goodbye came"
                got = _decode(follower.recv())
            assert closer.is_alive() and server.running(), "node 0 let go before its follower dropped the connection"
            follower.close(linger=0)
            closer.join(BYE_CONFIRM_S + 20)
            assert not closer.is_alive() and not server.running()
        assert "did not close their connection" not in caplog.text
        assert not lost, lost
    finally:
        follower.close(linger=0)
        if closer.is_alive():
            closer.join(30)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_node_0_drops_what_only_node_0_sends_and_beats_on() -> None:
    """A follower (or anything holding the secret) sending node 0 a ReplicaUp, a Welcome or a Verdict: each is
    dropped and counted, the heartbeat thread runs on and still answers the follower's beats; a drain request
    gets one line back (here: refused, nothing drains), and each follower is told its own verdict."""
    from rayfree.cluster.heartbeat_messages import DrainReplica, ReplicaUp, Verdict, Welcome

    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = _server(port, lost)
    server.verdict_fn = lambda: {1: "DP replica 1: node 1 is resting"}
    follower = _follower(port)
    try:
        for msg in (ReplicaUp(1, 1), Welcome({1: 3}), Verdict("")):
            follower.send(_encode(msg))
        follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), 2)))
        follower.send(_encode(DrainReplica(1)))
        got: list = []
        while len(got) < 50 and not (b"refused: nothing here drains" in got and server.dropped >= 3 and any(
            isinstance(m, Verdict) and m.reason.endswith("resting") for m in got if not isinstance(m, bytes)
        )):  # fmt: skip
            assert follower.poll(20_000), f"node 0 went quiet: {got}"
            raw = follower.recv()
            got.append(raw if raw.startswith(b"refused") else _decode(raw))
        assert server.dropped == 3 and server.running() and not lost, (server.dropped, lost)
        assert sum(isinstance(m, Beat) for m in got) >= 1, got  # its beats are still answered
    finally:
        follower.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_a_heartbeat_thread_that_could_not_run_says_so_and_for_how_long(caplog) -> None:
    """Another thread holds Python's lock for 2.5 s (as one importing torch does): node 0's heartbeat thread says
    it did not run, and how long; answering beats as usual, it says nothing."""
    port = get_open_port("127.0.0.1")
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 3.0, lambda n, r, ip, why: None)  # (1 s: said)
    server.start()
    follower = _follower(port)
    switch = sys.getswitchinterval()
    try:
        with caplog.at_level(logging.WARNING, logger="rayfree.cluster"):
            t_end, beats, slowest = time.monotonic() + 1.5, 1, 0.0
            while time.monotonic() < t_end:  # answered beats for 1.5 s: the thread runs
                beats += 1
                sent = time.monotonic()
                follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), beats)))
                assert follower.poll(20_000), "node 0 did not answer"
                follower.recv()
                slowest = max(slowest, time.monotonic() - sent)
            if slowest < 0.8:  # (else a busy machine did stall it: nothing to judge)
                assert "did not run" not in caplog.text, caplog.text
            sys.setswitchinterval(10.0)  # the heartbeat thread waits for the lock until this thread lets go
            t_end = time.monotonic() + 2.5
            while time.monotonic() < t_end:
                pass
            sys.setswitchinterval(switch)
            wait_until(lambda: "did not run" in caplog.text, 20, "node 0's word on its stall")
        said = re.search(r"node 0: its heartbeat thread did not run for ([0-9.]+)s", caplog.text)
        assert said and 1.0 < float(said.group(1)) < 15.0, caplog.text
    finally:
        sys.setswitchinterval(switch)
        follower.close(linger=0)
        server.close(timeout=10)


def _beats_until(sock: zmq.Socket, what: type, beat: Beat, tries: int = 200) -> object:
    """Beat (again and again, as a follower does) until node 0 answers with a `what`; that answer."""
    for seq in range(tries):
        sock.send(_encode(msgspec.structs.replace(beat, seq=beat.seq + seq)))
        if sock.poll(100):
            while sock.poll(0):
                got = _decode(sock.recv())
                if isinstance(got, what):
                    return got
    raise AssertionError(f"node 0 never answered node {beat.node_rank}'s process {beat.pid} with a {what.__name__}")


@pytest.mark.timeout(60)
def test_a_node_started_again_is_a_replacement_at_once_even_with_the_same_pid(caplog) -> None:
    """A launcher restarts a follower sooner than its silence could tell (the process is pid 1 again in its
    container): node 0 takes the never-welcomed process beating as that node for the node started again, loses
    the earlier process at once (not after its timeout) and admits the new one (its Welcome); the earlier
    process's beats are then refused as a stale incarnation's. Before, the same pid read as the same process
    (no loss, no Welcome, ever), and another pid's beats were dropped as stale until the timeout."""
    from rayfree.cluster.heartbeat_messages import Welcome

    port = get_open_port("127.0.0.1")
    lost: list[tuple[int, str]] = []
    admitted: list[tuple[int, int, str]] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 30.0, lambda n, r, ip, why: lost.append((n, why)))
    server.welcome_fn = lambda node: _encode(Welcome({0: 0, 1: len(admitted)}))
    server.admit = lambda node, pid, shape: admitted.append((node, pid, shape)) or len(admitted)
    server.start()
    first = make_dealer(f"tcp://127.0.0.1:{port}")
    again = make_dealer(f"tcp://127.0.0.1:{port}")
    pid = 1  # (as in a container)
    try:
        assert _beats_until(first, Welcome, Beat(1, [1], "10.0.0.2", pid, 1, shape="tp=1", incarnation=11)).epochs
        server.arm()  # (the cluster formed)
        _beats_until(first, Beat, Beat(1, [1], "10.0.0.2", pid, 5, incarnation=11))  # welcomed: no shape now
        welcome = _beats_until(again, Welcome, Beat(1, [1], "10.0.0.2", pid, 1, shape="tp=1", incarnation=22))
        assert welcome.epochs == {0: 0, 1: 1}, welcome  # type: ignore[attr-defined]
        assert lost and lost[0][0] == 1 and "it was started again (pid 1)" in lost[0][1], lost
        assert admitted == [(1, 1, "tp=1")], admitted  # one loss, one admission, well within the 30 s timeout
        dropped = server.dropped
        counted_when_said: list[int] = []  # the count another thread reads, as the line was written

        class Said(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "earlier incarnation" in record.getMessage():
                    counted_when_said.append(server.dropped)

        said = Said()
        logging.getLogger("rayfree.cluster").addHandler(said)
        try:
            first.send(_encode(Beat(1, [1], "10.0.0.2", pid, 9, incarnation=11)))  # the earlier process, resumed
            wait_until(lambda: server.dropped > dropped, 20, "node 0 refusing the earlier process's beat")
        finally:
            logging.getLogger("rayfree.cluster").removeHandler(said)
        # (once counted, the line is in the log: beside another suite the count was read before the line was written)
        assert counted_when_said == [dropped], counted_when_said
        assert "node 1's earlier incarnation (epoch 0 or before)" in caplog.text, caplog.text
        assert len(lost) == 1 and len(admitted) == 1, (lost, admitted)
    finally:
        first.close(linger=0)
        again.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_a_follower_node_0_lost_that_beats_again_is_told_it_was_lost() -> None:
    """Node 0 lost a follower (silent past the timeout: a process starved, a link that dropped) and failed its
    replicas without it; the same process then beats again (one still starting is not watching node 0's
    silence). Node 0 tells it, with why, so it leaves (non-zero, to be started again), instead of ignoring it:
    before, such a node still loading its model waited out ready_timeout_s, and was not even told of node 0's
    clean stop."""
    from rayfree.cluster.heartbeat_messages import Disowned

    port = get_open_port("127.0.0.1")
    lost: list[tuple[int, str]] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 0.6, lambda n, r, ip, why: lost.append((n, why)))
    server.start()
    follower = make_dealer(f"tcp://127.0.0.1:{port}")
    beat = Beat(1, [1], "127.0.0.1", os.getpid(), 1, incarnation=7)
    try:
        _beats_until(follower, Beat, beat)
        server.arm()
        wait_until(lambda: bool(lost), 20, "node 0 losing its silent follower")
        told = _beats_until(follower, Disowned, msgspec.structs.replace(beat, seq=100))
        assert told.reason.startswith("no heartbeat for ") and told.reason == lost[0][1], (told, lost)
        assert len(lost) == 1, lost  # (beating again changes nothing on node 0's side)
    finally:
        follower.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(30)
def test_a_confirmed_drop_shortens_only_its_own_window() -> None:
    """The rule that calls a silent peer lost: a dropped connection gives its peer RECONNECT_S to beat again; one
    a collective's error confirmed (`corroborate`) gives none. A drop after that one has its window again: a
    replacement whose link reconnects under load after an earlier loss was confirmed is not lost for it (the
    flag once stayed set for good, and such a replacement was lost as it reconnected)."""
    from rayfree.cluster.heartbeat_beater import RECONNECT_S, Beater
    from rayfree.transport.zmq.control import ControlSocket

    b = Beater(0.05, 5.0, "test-beater", "node 0")
    b._sock = ControlSocket.listen(f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}")
    try:
        t = time.monotonic()
        b.armed_at = t - 10
        first = t - 2.0  # the drop of the process that was lost; its peer last beat before it
        assert b._silent(first - 0.1, first + 0.1, first) is None  # within its window
        assert "connection dropped" in (b._silent(first - 0.1, first + RECONNECT_S + 0.01, first) or "")
        b.suspect_at = first
        b.corroborate()
        assert "connection dropped" in (b._silent(first - 0.1, first, first) or "")  # confirmed: at once
        later = t - 1.0  # the replacement's link drops, then reconnects
        b.suspect_at = later
        assert b._silent(later - 0.1, later + 0.01, later) is None, "a later drop kept the confirmed one's window"
        assert b._silence_due(later - 0.1, later) == pytest.approx(later + RECONNECT_S)
        assert "connection dropped" in (b._silent(later - 0.1, later + RECONNECT_S + 0.01, later) or "")
        b.corroborate()  # (a collective confirms this one too)
        assert "connection dropped" in (b._silent(later - 0.1, later, later) or "")
    finally:
        b._sock.close()


@pytest.mark.timeout(30)
def test_a_handshake_made_after_a_drop_gives_the_suspect_its_window_again() -> None:
    """A follower whose link dropped under load reconnects, and its first beat on the new connection comes later:
    a handshake node 0 saw after the drop starts the window again (once per handshake; the bound holds over all).
    A handshake before the drop lends nothing. (A replacement was lost so beside another suite on two cores.)"""
    from rayfree.cluster.heartbeat_beater import RECONNECT_S, Beater
    from rayfree.transport.zmq.control import ControlSocket

    b = Beater(0.05, 3.0, "test-beater", "node 0")
    b._sock = ControlSocket.listen(f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}")
    try:
        t = time.monotonic()
        b.armed_at, dropped = t - 10, t - 1.0
        b.reconnected_at = dropped - 0.1  # (before the drop: no help)
        assert "connection dropped" in (b._silent(dropped - 0.1, dropped + RECONNECT_S + 0.01, dropped) or "")
        b.reconnected_at = dropped + 0.25  # (a reconnection, late in the window)
        assert b._silent(dropped - 0.1, dropped + RECONNECT_S + 0.01, dropped) is None
        assert b._silence_due(dropped - 0.1, dropped) == pytest.approx(dropped + 0.25 + RECONNECT_S)
        assert "connection dropped" in (b._silent(dropped - 0.1, dropped + 0.26 + RECONNECT_S, dropped) or "")
        b.reconnected_at = dropped + 2.8  # (handshakes keep coming: the silence bound still ends it)
        assert "no heartbeat for 3.2s" in (b._silent(dropped - 0.1, dropped + 3.1, dropped) or "")
    finally:
        b._sock.close()


@pytest.mark.timeout(60)
def test_a_beat_that_waits_unread_when_the_window_ends_counts() -> None:
    """Node 0 judges a suspect on all that arrived: its beat came while node 0's thread was between its look and
    its judgement (held up under load), past the end of the reconnect window. Before, the beat waited unread and
    the follower was called lost."""
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 5.0, lambda n, r, ip, why: lost.append(n))
    follower = make_dealer(f"tcp://127.0.0.1:{port}")
    try:
        sock = server._sock
        follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), 1)))
        seq = 0
        wait_until(lambda: server._take(sock, 100, 0, seq) and server.peers[1].last_seen is not None, 20)
        assert follower.poll(20_000), "node 0 never answered the beat"
        now = time.monotonic()
        server.armed_at, peer = now - 10, server.peers[1]
        peer.last_seen, peer.dropped_at = now - 1.1, now - 1.0  # (its link dropped a second ago; it was silent)
        server.reconnected_at = now - 2  # (its handshake came before the drop)
        server._look_at = 0.0
        follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), 2)))  # (it reconnected and beat)
        assert sock._sock.poll(20_000), "the beat never reached node 0's socket"
        server._judge(sock, 0, seq)
        assert lost == [] and not peer.gone and peer.dropped_at is None, peer.lost_why
    finally:
        follower.close(linger=0)
        server.close(timeout=10)


def test_a_heartbeat_threads_own_stall_is_not_its_peers_silence() -> None:
    """The rule, on times: a thread that was held up (its last look long ago) gives a peer heard from before its
    stall its whole bound again from when it runs again, and a dropped connection its reconnect window from then;
    a peer silent past the bound while the thread ran is still lost, the silence named in full."""
    from rayfree.cluster.heartbeat_beater import RECONNECT_S, Beater
    from rayfree.transport.zmq.control import ControlSocket

    b = Beater(0.05, 3.0, "test-beater", "node 0")
    b._sock = ControlSocket.listen(f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}")
    try:
        t = time.monotonic()
        b.armed_at, b._ran_at = t - 20, t - 0.5  # (looked half a second ago: not held up)
        assert "no heartbeat for 5.0s" in (b._silent(t - 5, t, None) or ""), "a peer silent while it ran"
        b._ran_at = t - 4  # this thread's last look was 4 s ago: it was held up (a third of the bound is enough)
        assert b._silent(t - 5, t, None) is None, "its own stall counted against the peer"
        assert b._silence_due(t - 5, None) >= t + 3.0
        assert b._silent(t - 5, t + 2.9, None) is None
        assert "no heartbeat for 8.1s" in (b._silent(t - 5, t + 3.1, None) or ""), "silent a whole bound after"
        assert b._silent(t - 5, t + 0.1, t - 2) is None  # dropped during the stall: its window counts from now
        assert "connection dropped" in (b._silent(t - 5, t + RECONNECT_S + 0.01, t - 2) or "")
    finally:
        b._sock.close()


@pytest.mark.timeout(60)
def test_node_0_held_up_past_the_bound_loses_no_follower_that_beats_again_at_once() -> None:
    """Another thread holds Python's lock for 2.5 s, past the 1.5 s bound (as a thread importing torch can under
    load): the follower could not beat meanwhile either (it shares the lock here, as a starved machine's processes
    share its cores), and beats again at once; node 0 calls nobody lost (it did, before: its own stall counted as
    the follower's silence)."""
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 1.5, lambda n, r, ip, why: lost.append(n))
    server.start()
    follower = _follower(port)
    switch, seq = sys.getswitchinterval(), 0

    def beat_for(seconds: float) -> None:
        nonlocal seq
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            seq += 1
            follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), seq)))
            assert follower.poll(20_000), "node 0 did not answer"
            while follower.poll(0):
                follower.recv()
            time.sleep(0.05)  # (the beat's rhythm, as a follower's thread keeps it)

    try:
        beat_for(0.3)
        server.arm()
        beat_for(0.5)
        sys.setswitchinterval(10.0)  # node 0's heartbeat thread waits for the lock until this thread lets go
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:
            pass
        sys.setswitchinterval(switch)
        beat_for(2.0)
        assert not lost and server.running(), lost
    finally:
        sys.setswitchinterval(switch)
        follower.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_a_heartbeat_thread_that_crashes_is_a_failure_its_domain_hears_of() -> None:
    """A heartbeat thread that raises stops watching the peers: the domain it was started for (the node's
    policy, in liveness.py) gets a FATAL `ThreadCrashed` naming it, not a log line nobody acts on. Here node 0's
    welcome for a follower's first beat raises. Started twice: refused (construct, wire, then start once)."""
    from rayfree.supervisor import Failure, Severity, SupervisorMisuse, ThreadCrashed

    heard: list[Failure] = []
    got = threading.Event()

    class Domain:
        def apply(self, failure: Failure) -> None:
            heard.append(failure)
            got.set()

    def welcome(node: int) -> bytes:
        raise RuntimeError("the welcome could not be built")

    port = get_open_port("127.0.0.1")
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 5.0, lambda n, r, ip, why: None)
    server.welcome_fn = welcome
    server.start(Domain())
    follower = make_dealer(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(SupervisorMisuse, match="started already"):
            server.start()
        follower.send(_encode(Beat(1, [1], "127.0.0.1", os.getpid(), 1)))
        assert got.wait(20), "the crash was not reported"
        assert server.join(20) and not server.running()
    finally:
        follower.close(0)
        server.close()
    [f] = heard
    assert f.severity is Severity.FATAL and f.source == "thread RayfreeHeartbeatServer", f
    assert isinstance(f.cause, ThreadCrashed) and "the welcome could not be built" in str(f.cause), f.cause


@pytest.mark.timeout(60)
def test_a_followers_failed_goodbye_waits_for_a_dropped_peer_whose_loss_may_be_its_cause() -> None:
    """Two followers of one replica; node 1's process is killed (its connection drops), and node 2's worker, whose
    collective with it broke, fails its node, which says goodbye (failed) before node 0 has judged node 1. Node 0
    decides node 1 first (the cause) and node 2's goodbye after it. Before, the goodbye counted at once, and the
    replica was lost for node 2's broken collective instead of node 1's death (a CI run met it)."""
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1], 2: [2]}, 0.05, 5.0, lambda n, r, ip, why: lost.append(n))
    socks = {k: make_dealer(f"tcp://127.0.0.1:{port}") for k in (1, 2)}
    try:
        server.start()
        for k, sock in socks.items():
            sock.send(_encode(Beat(k, [k], "127.0.0.1", os.getpid(), 1)))
            assert sock.poll(20_000), f"node 0 never answered node {k}'s beat"
        server.arm()
        socks.pop(1).close(linger=0)  # (killed: its connection drops at once)
        wait_until(lambda: server.suspect_at is not None, 10, "node 0 to see a connection drop")
        socks[2].send(_encode(Bye(2, False, "worker rank 2 raised RuntimeError: Connection closed by peer")))
        wait_until(lambda: len(lost) == 2, 10, "both followers counted lost")
        assert lost == [1, 2], lost
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_a_node_node_0_forgot_is_not_called_lost_and_started_again_is_admitted() -> None:
    """A node 0 started again resumed a cluster whose replica on node 2 was drained meanwhile (`forget`): node 2's
    silence past the bound is no loss (node 1's is: it was expected and never beat), and node 2 started again is
    admitted as a replacement."""
    port = get_open_port("127.0.0.1")
    lost: list[int] = []
    admitted: list[tuple[int, int]] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1], 2: [2]}, 0.05, 0.6, lambda n, r, ip, why: lost.append(n))
    server.admit = lambda node, pid, shape: admitted.append((node, pid)) or 1
    server.start()
    again = make_dealer(f"tcp://127.0.0.1:{port}")
    try:
        server.forget([2], "its DP replica(s) [2] were drained before node 0 was started again")
        server.arm()
        wait_until(lambda: lost, 20, "node 1's silence called a loss")
        t_lost = time.monotonic()
        wait_until(lambda: time.monotonic() - t_lost > 1.0, 5, "a second more")  # (past node 2's bound too)
        assert lost == [1], lost
        assert {v[0]: v[4] for v in server.peer_views()} == {1: True, 2: True}  # (both out: node 2 not waited for)
        _beats_until(again, Beat, Beat(2, [2], "10.0.0.3", 4242, 1, shape="tp=1", incarnation=5))
        assert admitted == [(2, 4242)] and lost == [1], (admitted, lost)
    finally:
        again.close(linger=0)
        server.close(timeout=10)


@pytest.mark.timeout(60)
def test_with_the_watch_a_follower_node_0_watches_stopped_right_after_a_beat_is_lost_within_a_second(
    monkeypatch,
) -> None:
    """The watch on: node 0 sends no pings and holds each connection to the TTL its follower's pings carry, which
    libzmq disarms at every data frame until the next ping. A follower stopped right after a beat (its last frame)
    is then never timed out by that connection; its ping-only link to node 0 (heartbeat_links.py) is, and node 0
    finds it lost within a second, not after the beats' 10 s."""
    import subprocess

    monkeypatch.setenv("RAYFREE_WATCH_FANOUT", "8")
    port = get_open_port("127.0.0.1")
    lost: list[tuple[int, str]] = []
    server = HeartbeatServer("127.0.0.1", port, {1: [1]}, 0.05, 10.0, lambda n, r, ip, why: lost.append((n, why)))
    server.start()
    server.arm()
    argv = [sys.executable, "-m", "tests.support.beat_then_stop", str(port), "--link"]
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None and follower.stdout.readline().strip() == "STOPPING"
        t_stop = time.monotonic()
        wait_until(lambda: lost, 8, "node 0 calling the stopped follower lost")
        took = time.monotonic() - t_stop
        assert lost[0][0] == 1 and "connection dropped" in lost[0][1], lost
        assert took < 2.0, f"lost after {took:.2f}s: {lost}"
    finally:
        follower.kill()
        follower.wait(10)
        server.close(timeout=10)
