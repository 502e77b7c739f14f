"""Heartbeats between node 0 and every other node: a lost node is noticed in bounded time.

vLLM's head waits for a dead node's replies until the RPC timeout, and its
followers keep running when the head dies. Here every follower sends a `Beat`
to the leader each interval and the leader answers each one; a side that hears
nothing from the other for `timeout` seconds reports the other lost. A node
that stops on purpose says `Bye`, so a clean stop is not mistaken for a loss.

Loss is judged from the connection, not from the beats' timing: both ends
ping each other in libzmq's I/O thread (RAYFREE_LINK_TIMEOUT_S, no Python and
no GIL involved), so a peer killed, stopped (SIGSTOP) or cut off drops its
connection within that bound, and a starved interpreter that beats late drops
nothing. A dropped connection makes its peer suspect (node 0 asks which peer
by sending to each: ZeroMQ refuses a peer with no connection), and a suspect
that does not connect and beat again within RECONNECT_S is lost. The beats
themselves carry status and the readiness verdict; their own timeout is the
fallback for a process whose Python is stuck while its sockets live.

Liveness is only enforced once `arm()` is called (when the executor is ready):
before that, start-up may legitimately take minutes (model load), and the
workers' own join timeout bounds it. The sockets are the transport's
`ControlSocket`s (transport/zmq/control.py): this module never holds a socket.
This module has node 0's side; a follower's is heartbeat_client.py, the messages heartbeat_messages.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import msgspec

from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket

from . import heartbeat_messages as msgs
from .heartbeat_beater import BYE_LINGER_MS, IDLE_LOOK_S, RECONNECT_S, Beater, LostCallback, wait_ms
from .heartbeat_links import FIND_DROPPED_S, Links
from .heartbeat_messages import Beat, Bye, Verdict, _decode, _encode
from .heartbeat_peer import FollowerPeer, answer, await_goodbyes, log_waiting, process_of, say_bye, tell_latecomers
from .heartbeat_returns import Returns
from .watch import WatchBook, watch_on

__all__ = ["Beat", "Bye", "Verdict", "HeartbeatServer"]

logger = logging.getLogger("rayfree.cluster")


#: how often node 0 says which followers it still waits for at start-up
JOIN_LOG_S = 5.0


#: how often node 0 judges the cluster's readiness for its followers: while it is not ready (start-up, trouble),
#: and while it is (a rank stopped on node 0, a call stalled: the followers' /readyz hears it within this); while
#: ready, a wake for a beat judges too once VERDICT_BESIDE_S has passed, so the verdict rarely wakes the thread
VERDICT_S = 0.1
VERDICT_READY_S = 0.5
VERDICT_BESIDE_S = 0.25

#: how long a leader that failed keeps answering followers that have not beaten yet with its goodbye
TELL_LATE_S = 2.0


class HeartbeatServer(Returns, Links, Beater):
    """On the leader: answers every follower's beat and reports a follower that falls silent."""

    def __init__(
        self,
        bind_ip: str,
        port: int,
        followers: dict[int, list[int]],
        interval: float,
        timeout: float,
        on_lost: LostCallback,
        join_timeout: float | None = None,
    ) -> None:
        super().__init__(interval, timeout, "RayfreeHeartbeatServer", "node 0")
        #: who watches which follower's quick link, where not node 0, and where (watch.py)
        self.watch = WatchBook()
        #: how long the followers have to join (the progress lines say how much of it has passed)
        self.join_timeout = join_timeout
        self.endpoint = tcp_endpoint(bind_ip, port)
        self.peers = {k: FollowerPeer(k, ranks) for k, ranks in followers.items()}
        self.on_lost = on_lost
        #: answers a StatusQuery (set by the layer above); None: the query gets an empty reply
        self.status_fn: Callable[[], bytes] | None = None
        #: each follower's readiness verdict by node ("" ready, else why not; set by the layer above), pushed
        self.verdict_fn: Callable[[], dict[int, str]] | None = None
        #: "" once every follower was last told it is ready
        self.verdict = "starting"
        #: `rayfree drain`: drain this DP replica, and the line to answer (the layer above); None: refused
        self.drain_fn: Callable[[int], str] | None = None
        self.scale_fn: Callable[[int], str] | None = None
        self._verdict_at = 0.0
        #: after a failure, how long followers that have not beaten yet are waited for, to be told
        self.tell_late_s = TELL_LATE_S
        #: a lost node beats again from another process (node, pid, its shape): its epoch if admitted, why if refused
        self.admit: Callable[[int, int, str], int | str | None] | None = None
        #: a follower serves on without node 0 (node, its beat: Beat.alone), heard while this node 0 starts (the
        #: layer above; None: its join's timeout tells); once armed, `adopt` gives what takes such a follower back
        #: (a Resumed, encoded; None: it is lost, as one that left the cluster)
        self.on_alone: Callable[[int, Beat], None] | None = None
        self.adopt: Callable[[int, Beat], bytes | None] | None = None
        #: a follower's first beat, before it is welcomed (the layer above; None: welcomed at once): True holds it
        #: (node 0 does not know yet whether it starts the cluster or resumes one; `heard` counts it), a string
        #: counts the follower lost, why (a process started beside a node 0 that resumes: a replacement)
        self.hold: Callable[[int], bool | str] | None = None
        self.heard: set[int] = set()
        self._alone_heard: set[int] = set()
        self._to_forget: list[tuple[list[int], str]] = []
        #: node 0's first answer to a follower (a Welcome, encoded; the layer above), or None
        self.welcome_fn: Callable[[int], bytes] | None = None
        #: what other threads asked this one to send: (to which nodes, what), sent at its next turn
        self._to_send: list[tuple[list[int], bytes]] = []
        #: no follower falls silent before this (the earliest deadline at the last look: a beat only puts one
        #: later); 0: look now. A look per deadline, not per message: a large cluster beats hundreds a second
        self._look_at = self._probed_at = 0.0
        #: followers' failed goodbyes held while another connection's drop is judged (its loss may be their cause)
        self._held_byes: list[tuple[float, FollowerPeer, str]] = []
        # (in the caller's thread: a busy port fails the start-up; with watchers, each follower paces its own link)
        self._quiet, self._pinging = watch_on(), set()
        self._sock = ControlSocket.listen(self.endpoint, pings=not self._quiet)

    def tell(self, nodes: list[int], msg: msgs.Told) -> None:
        """Send `msg` to these followers (any thread: the heartbeat thread owns the socket and sends it)."""
        self._to_send.append((nodes, _encode(msg)))
        self._sock.wake()

    def join(self, timeout: float) -> bool:
        """As `Beater.join`; after a failure the thread first tells late followers (`tell_late_s`)."""
        bye = self._bye
        return super().join(timeout + (self.tell_late_s if bye is not None and not bye.clean else 0.0))

    def _run(self) -> None:
        sock = self._sock
        poll_ms = int(min(self.interval, 0.1) * 1000)
        me = os.getpid()
        seq = 0
        started = time.monotonic()
        next_log = started + JOIN_LOG_S
        sock.watch()
        try:
            while not self._stop.is_set():
                before = seq
                seq = self._take(sock, wait_ms(self._next_due(next_log)), me, seq)
                self._forget_now()
                if self.suspect_at is not None and time.monotonic() - self.suspect_at < 2 * RECONNECT_S:
                    self._find_dropped(sock, self.suspect_at)  # (ZeroMQ drops the peer's pipe a little later)
                seq = self._judge(sock, me, seq)
                if self.armed_at is None and time.monotonic() >= next_log:
                    log_waiting(self.peers, time.monotonic() - started, self.join_timeout, self._alone_heard)
                    next_log = time.monotonic() + JOIN_LOG_S
                self._push_verdict(sock, beside=seq != before)
                self._send_told(sock)
            self._send_told(sock)
            await_goodbyes(sock, self.peers, say_bye(sock, self.peers, self._bye))
            if self._bye is not None and not self._bye.clean:  # (a failure, often at start-up)
                tell_latecomers(sock, self.peers, self._bye, self.tell_late_s, lambda: self._receive(sock, poll_ms))
        finally:
            sock.close(BYE_LINGER_MS if self._bye is not None else 0)  # the bye goes out first

    def _take(self, sock: ControlSocket, wait: int, me: int, seq: int) -> int:
        """Read and answer what arrives within `wait` ms; returns the last beat's sequence number. A handshake
        made is a suspect that may be reconnecting: its window counts again from then (`Beater._window_from`)."""
        for frames in self._receive(sock, wait):
            seq += 1
            self._on_message(sock, frames, me, seq)
        if sock.take_connected():
            self.reconnected_at = time.monotonic()
        return seq

    def _judge(self, sock: ControlSocket, me: int, seq: int) -> int:
        """Call the followers silent past their bound lost, judged on all that arrived: a beat may have come
        while this thread was between its look and now (under load that can be most of a reconnect window)."""
        if self._loss_due():
            seq = self._take(sock, 0, me, seq)
        self._check()
        return seq

    def _loss_due(self) -> bool:
        """Would `_check` call a follower lost now?"""
        now = time.monotonic()
        if self.armed_at is None or now < self._look_at:
            return False
        return any(not p.gone and self._silent(p.last_seen, now, p.dropped_at) for p in self.peers.values())

    def _on_message(self, sock: ControlSocket, frames: list[bytes], me: int, seq: int) -> None:
        if len(frames) != 2:
            self._dropped(f"a message of {len(frames)} frames")
            return
        identity, payload = frames
        try:
            msg = _decode(payload)
        except msgspec.DecodeError as e:
            self._dropped(f"an unreadable message ({e})")
            return
        if isinstance(msg, (msgs.StatusQuery, msgs.DrainReplica, msgs.ScaleReplicas)):
            sock.try_send([identity, answer(self, msg)])
            return
        if isinstance(msg, msgs.WatchLost):
            self._watch_lost(msg, identity)
            return
        if not isinstance(msg, (Beat, Bye)):  # a verdict, a welcome, word on a replica: only node 0 sends them
            self._dropped(f"a {type(msg).__name__} sent to node 0 (only node 0 sends them)")
            return
        if isinstance(msg, Beat) and msg.alone:
            self._alone(sock, identity, msg)
            return
        peer = self.peers.get(msg.node_rank)
        if peer is None and isinstance(msg, Beat) and msg.shape and self.armed_at and self.admit is not None:
            peer = self._newcomer(sock, identity, msg)
            if peer is None:
                return
        elif peer is None:
            self._dropped(
                f"a message from node {msg.node_rank}, which is not a follower of this leader "
                f"(followers: {sorted(self.peers)})"
            )
            return
        if peer.gone and peer.lost_why and isinstance(msg, Beat) and process_of(msg) == peer.proc:
            sock.try_send([identity, _encode(msgs.Disowned(peer.lost_why))])  # (it leaves, to be started again)
            return
        if peer.gone:
            epoch = self._admitted(peer, msg)
            if epoch is None or isinstance(epoch, str):  # (refused: it is told why, and leaves)
                if epoch is not None:
                    sock.try_send([identity, _encode(msgs.Refused(epoch))])
                return
            peer.reincarnate(msg, epoch)  # type: ignore[arg-type]
            self._look_at = 0.0  # (its deadline counts again)
        elif isinstance(msg, Beat) and msg.shape and self.armed_at and peer.proc not in (None, process_of(msg)):
            self._started_again(peer, msg)  # (its next beat is a replacement's)
            return
        elif peer.epoch and (identity != peer.identity if isinstance(msg, Bye) else process_of(msg) != peer.proc):
            self._dropped(
                f"a message from node {peer.node_rank}'s earlier incarnation (epoch {peer.epoch - 1} or before), "
                f"after its replacement (pid {peer.pid}) joined in epoch {peer.epoch}"
            )
            return
        if isinstance(msg, Bye):
            peer.gone, peer.bye_from = True, identity
            logger.warning("follower node %d (%s) stopped: %s", peer.node_rank, peer.ip, msg.reason)
            now, dropped = time.monotonic(), self.suspect_at
            if not msg.clean and self.armed_at is not None and dropped is not None and now - dropped < 2 * RECONNECT_S:
                self._held_byes.append((dropped + 2 * RECONNECT_S, peer, f"it stopped ({msg.reason})"))
                self._look_at = 0.0  # (a node whose drop caused this failure is found and decided first: _check)
                return
            self.on_lost(peer.node_rank, peer.ranks, peer.ip, f"it stopped ({msg.reason})")
            return
        if peer.last_seen is None and not peer.epoch and self.hold is not None and self._held(peer, msg):
            return
        if peer.last_seen is None:
            logger.info("follower node %d (%s, ranks %s) is beating", msg.node_rank, msg.ip, msg.ranks)
            if self.welcome_fn is not None:
                sock.try_send([identity, self.welcome_fn(peer.node_rank)])
            sock.try_send([identity, _encode(Verdict(peer.verdict))])
        if isinstance(msg, Beat) and self.watch.news(node := peer.node_rank, msg, first := peer.last_seen is None):
            self.watch.heard(node, msg, first, lambda k, m: self._send_told(
                sock, [([k], _encode(m))]) if k != node else sock.try_send([identity, _encode(m)]))  # fmt: skip
        if isinstance(msg, Beat):
            self._saw_link(sock, msg)
        peer.identity, peer.ip, peer.last_seen, peer.done = identity, msg.ip, time.monotonic(), msg.done
        peer.pid, peer.proc, peer.dropped_at = msg.pid, process_of(msg), None
        if msg.status:
            peer.status = msg.status
        # False: its queue is full: it is not reading, and its own timeout will tell it
        sock.try_send([identity, _encode(Beat(0, [], "", me, seq))])

    def _watch_lost(self, msg: msgs.WatchLost, identity: bytes) -> None:
        """A follower's watcher lost its link (watch.py): lost, as one whose own link dropped for good."""
        peer, w = self.peers.get(msg.node_rank), self.watch.of.get(msg.node_rank, 0)
        if w not in self.peers or self.peers[w].identity != identity:
            self._dropped(f"word of node {msg.node_rank}'s loss from a node that does not watch it")
        elif peer is not None and not peer.gone and self.armed_at is not None:
            peer.gone, peer.lost_why = True, f"its watcher (node {w}): {msg.reason}"
            logger.error("follower node %d (%s, ranks %s) lost: %s", peer.node_rank, peer.ip, peer.ranks, peer.lost_why)
            self.on_lost(peer.node_rank, peer.ranks, peer.ip, peer.lost_why)

    def _newcomer(self, sock: ControlSocket, identity: bytes, msg: Beat) -> FollowerPeer | None:
        """A node past those the cluster started with beats (a scale-out's new replica): admitted as a lost
        node's replacement is, in its replica's epoch, or told why not (and forgotten)."""
        peer = FollowerPeer(msg.node_rank, list(msg.ranks))
        peer.gone = True
        self.peers[msg.node_rank] = peer  # (other threads copy the dict before they read it)
        epoch = self._admitted(peer, msg)
        if epoch is None or isinstance(epoch, str):
            del self.peers[msg.node_rank]
            if epoch is not None:
                sock.try_send([identity, _encode(msgs.Refused(epoch))])
            return None
        peer.reincarnate(msg, epoch)
        self._look_at = 0.0
        return peer

    def _admitted(self, peer: FollowerPeer, msg: Beat | Bye) -> int | str | None:
        """A lost node beats again: from another process, a replacement node 0 may admit (epoch) or refuse (why)."""
        if not isinstance(msg, Beat) or process_of(msg) == peer.proc or self.admit is None:
            return None
        return self.admit(peer.node_rank, msg.pid, msg.shape)

    def _started_again(self, peer: FollowerPeer, msg: Beat) -> None:
        """A process never welcomed beats as a node node 0 counts alive: the node was started again (its launcher
        restarted it sooner than its silence could tell), so the earlier process is lost now, not after its
        timeout, and the new one is a replacement (until then its beats read as a stale incarnation's)."""
        peer.gone = True  # (no lost_why: the process that beats now is another, which the next beat may admit)
        why = (f"it was started again (pid {msg.pid}) while node 0 still counted on its earlier process "
               f"(pid {peer.pid})")  # fmt: skip
        logger.error("follower node %d (%s, ranks %s) lost: %s", peer.node_rank, peer.ip, peer.ranks, why)
        self.on_lost(peer.node_rank, peer.ranks, peer.ip, why)

    def _next_due(self, next_log: float) -> float:
        """When the loop must look again if nothing arrives (a beat, a dropped connection and a stop wake it):
        the next verdict, a peer's silence deadline or reconnect window, the join's progress line."""
        now = time.monotonic()
        due = now + IDLE_LOOK_S
        if self.verdict_fn is not None:
            due = min(due, self._verdict_at + (VERDICT_S if self.verdict else VERDICT_READY_S))
        if self.suspect_at is not None and now - self.suspect_at < 2 * RECONNECT_S:
            due = min(due, now + FIND_DROPPED_S)  # whose connection dropped (ZeroMQ drops the pipe a little later)
        if self.armed_at is None:
            return min(due, next_log)
        return min(due, self._look_at)

    def corroborate(self) -> None:
        self._look_at = 0.0  # (a suspect's deadline is now)
        super().corroborate()

    def _check(self) -> None:
        now = time.monotonic()
        if self.armed_at is None or now < self._look_at:
            return
        look_at = now + IDLE_LOOK_S
        for peer in self.peers.values():
            if peer.gone:
                continue
            why = self._silent(peer.last_seen, now, peer.dropped_at)
            if why is None:
                look_at = min(look_at, self._silence_due(peer.last_seen, peer.dropped_at))
            else:
                peer.gone = True
                if peer.last_seen is None:
                    why = f"it never sent a heartbeat to {self.endpoint} (is that port reachable from it?)"
                peer.lost_why = why
                logger.error("follower node %d (%s, ranks %s) lost: %s", peer.node_rank, peer.ip, peer.ranks, why)
                self.on_lost(peer.node_rank, peer.ranks, peer.ip, why)
        for _due, peer, why in [h for h in self._held_byes if h[0] <= now]:
            self.on_lost(peer.node_rank, peer.ranks, peer.ip, why)
        self._held_byes = [h for h in self._held_byes if h[0] > now]
        self._look_at = min([look_at, *(h[0] for h in self._held_byes)])

    def _push_verdict(self, sock: ControlSocket, beside: bool = False) -> None:
        """Every VERDICT_S (VERDICT_READY_S while ready, or VERDICT_BESIDE_S `beside` a wake for a message), each
        follower's readiness; sent to it when it changed."""
        now = time.monotonic()
        every = VERDICT_S if self.verdict else VERDICT_BESIDE_S if beside else VERDICT_READY_S
        if self.verdict_fn is None or now - self._verdict_at < every:
            return
        self._verdict_at = now
        try:
            verdicts = self.verdict_fn()
        except Exception:  # noqa: BLE001 - a readiness check must never stop the heartbeats
            logger.exception("heartbeat: could not judge the cluster's readiness")
            return
        self.verdict = next((v for v in verdicts.values() if v), "")
        for k, peer in self.peers.items():
            verdict = verdicts.get(k, "")
            if peer.identity is not None and not peer.gone and verdict != peer.verdict:
                peer.verdict = verdict
                sock.try_send([peer.identity, _encode(Verdict(verdict))])

    def _send_told(self, sock: ControlSocket, told: list[tuple[list[int], bytes]] | None = None) -> None:
        told = self._to_send if told is None else told
        while told:
            nodes, payload = told.pop(0)
            for k in nodes:
                peer = self.peers.get(k)
                if peer is not None and peer.identity is not None and not peer.gone:
                    sock.try_send([peer.identity, payload])

    def peer_views(self) -> list[tuple[int, str, list[int], float | None, bool, bytes]]:
        """(node, ip, ranks, seconds since its last beat or None, lost or gone, its last status) per follower."""
        now = time.monotonic()
        return [
            (p.node_rank, p.ip, p.ranks, None if p.last_seen is None else now - p.last_seen, p.gone, p.status)
            for p in list(self.peers.values())
        ]

    def all_done(self, nodes: list[int]) -> bool:
        """Have these nodes all reported `done`?"""
        return all(self.peers[k].done for k in nodes)
