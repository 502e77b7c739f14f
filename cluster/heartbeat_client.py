"""A follower node's side of the heartbeats (heartbeat.py has the protocol and node 0's side), and the status
query `rayfree status` sends node 0."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

import msgspec

from rayfree.supervisor import FailureDomain
from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket

from .heartbeat_beater import BYE_LINGER_MS, RECONNECT_S, STATUS_MAX_BYTES, WAIT_LOG_S, Beater, ByeCallback, wait_ms
from .heartbeat_messages import (
    Beat,
    Bye,
    Disowned,
    DrainReplica,
    Refused,
    Regroup,
    ReplicaDown,
    ReplicaUp,
    Resumed,
    StatusQuery,
    Verdict,
    WatchBy,
    Welcome,
    WidthSet,
    _decode,
    _encode,
)  # fmt: skip
from .heartbeat_watched import Watched
from .watch import WatchServer, watch_link, watch_on

__all__ = ["HeartbeatClient", "query_status", "ask_node0"]

logger = logging.getLogger("rayfree.cluster")


class HeartbeatClient(Watched, Beater):
    """On a follower: beats toward the leader; reports the leader lost, or gone on purpose (`Bye`)."""

    def __init__(
        self,
        master_addr: str,
        port: int,
        node_rank: int,
        ranks: list[int],
        ip: str,
        interval: float,
        timeout: float,
        on_lost: Callable[[str], bool | None],
        on_bye: ByeCallback,
        shape: str = "",
        watcher: int = 0,
        children: list[int] | None = None,
    ) -> None:
        if watcher:  # (its quick link goes to its watcher: node 0 hears it less often, watch.py)
            interval = min(2 * interval, timeout / 3)
        super().__init__(interval, timeout, "RayfreeHeartbeatClient", f"node {node_rank}")
        self.endpoint = tcp_endpoint(master_addr, port)
        self.node_rank = node_rank
        self.ranks = ranks
        self.ip = ip
        #: node 0 lost (why); True: this node serves on without it, and beats on `alone`
        self.on_lost = on_lost
        self.on_bye = on_bye
        #: why node 0 was lost, once this node serves on without it: its beats say so to whoever answers at
        #: node 0's address from then on, and it hears nothing of them
        self.alone = ""
        #: every DP replica's epoch as this node knew them when it lost node 0 (the layer above, as it goes alone)
        self.alone_epochs: dict[int, int] = {}
        #: the replicas out of service as this node knows them and the requested width, read at each beat `alone`
        self.alone_out: Callable[[], tuple[list[ReplicaDown], int]] = lambda: ([], 0)
        #: a node 0 started again leads the cluster again and takes this node back (the layer above; None: a
        #: node serving alone hears nothing of any node 0)
        self.on_resumed: Callable[[Resumed], None] | None = None
        #: node 0 says a DP replica was lost, is back, or drains (set by the layer above; None: not expected)
        self.on_replica_down: Callable[[ReplicaDown], None] | None = None
        self.on_replica_up: Callable[[ReplicaUp], None] | None = None
        self.on_replica_drain: Callable[[DrainReplica], None] | None = None
        self.on_regroup: Callable[[Regroup], None] | None = None
        self.on_width: Callable[[WidthSet], None] | None = None
        #: node 0 counts this node lost and will not take this process back (Disowned): why (the layer above;
        #: None: dropped)
        self.on_disowned: Callable[[str], None] | None = None
        self._disowned = False
        #: node 0's first answer (the epochs of this node's replicas), once it came
        self.welcome: Welcome | None = None
        self.welcomed = threading.Event()
        #: the cluster's shape as this node was started (sent until node 0 welcomes it), and node 0's refusal
        #: of this node as a replacement (why), which also sets `welcomed`
        self.shape = shape
        self.refused: str | None = None
        self.contact = threading.Event()
        self.last_reply: float | None = None
        #: node 0's last word on the cluster's readiness ("" ready; see Verdict)
        self.leader_verdict = "node 0 has not answered yet"
        #: carried by every beat from now on (see Beat.done)
        self.done = False
        #: this node's status for node 0 (set by the layer above), sent with every beat
        self.status_fn: Callable[[], bytes] | None = None
        #: round trips of beats to node 0: the last one, and their count and sum (seconds)
        self.rtt_s: float | None = None
        self.rtt_count = 0
        self.rtt_sum = 0.0
        self._sent_at = 0.0
        #: this node's watcher (0: node 0, over this link) and its link to it once node 0 said where (WatchBy);
        #: the children this node watches, and what its watch of them has to tell node 0
        self.watcher = watcher
        self._watch_link: ControlSocket | None = None
        self._watch_at = ""
        #: when this node's link to its watcher dropped (None: up, or none yet)
        self._watch_down_at: float | None = None
        self._to_send: list[bytes] = []
        #: the children its watch found lost, and why (said again to the layer above once node 0 is lost too)
        self._children_lost: dict[int, str] = {}
        #: node 0 lost and this node serving on: a node of this node's watch lost (a child, or its own watcher:
        #: `_watch_link_lost`), whose replica nobody else will call lost (the layer above; None: not expected)
        self.on_watch_lost: Callable[[int, str], None] | None = None
        self.watch: WatchServer | None = None
        #: node 0 watches this node itself and sends no pings (the watch on): a link that carries nothing but this
        #: node's pings keeps node 0's bound on it armed (heartbeat_links.py), opened by this thread
        self._ping_link = not watcher and watch_on()
        #: its quick link is another (to its watcher, or that ping-only one): this one's pings only hold it to
        #: the beats' bound
        slow = bool(watcher) or self._ping_link
        self._sock = ControlSocket.connect(self.endpoint, link_timeout_s=timeout if slow else None)
        if children:
            self.watch = WatchServer(ip, children, timeout, self._child_lost)

    def start(self, domain: FailureDomain | None = None) -> None:
        if self.watch is not None:  # (first: its children hear of it only once this thread beats)
            self.watch.start(domain)
        super().start(domain)

    def arm(self) -> None:
        super().arm()
        if self.watch is not None:
            self.watch.arm()

    def stop(self, bye: Bye | None = None) -> None:
        super().stop(bye)
        if self.watch is not None:  # (node 0 lost: this node's children hear how it ended from it)
            said = bye or Bye(self.node_rank, True, f"node {self.node_rank}, its watcher, stopped cleanly")
            self.watch.stop(said if self.alone else None)

    def join(self, timeout: float) -> bool:
        done = super().join(timeout)
        return (self.watch is None or self.watch.join(timeout)) and done

    def _run(self) -> None:
        sock = self._sock
        pid, incarnation = os.getpid(), secrets.randbits(62)
        seq = 0
        next_beat = 0.0
        started = next_log = time.monotonic()
        next_log += WAIT_LOG_S
        dropped: float | None = None
        sock.watch()
        to_node_0 = watch_link(self.endpoint, self.node_rank) if self._ping_link else None
        if to_node_0 is not None:  # (and its drop makes node 0 suspect, as the beat link's would)
            sock.follow(to_node_0)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    if self.refused is None:  # (refused: it leaves, and beats no more)
                        seq += 1
                        shape = "" if self.welcomed.is_set() else self.shape
                        out, requested = self.alone_out() if self.alone else ([], 0)
                        beat = Beat(
                            self.node_rank, self.ranks, self.ip, pid, seq, self.done, self._status(), shape,
                            incarnation, self.alone, self.alone_epochs if self.alone else {}, out, requested,
                            "" if self.watch is None else self.watch.endpoint, self.watcher,
                        )  # fmt: skip
                        if sock.try_send([_encode(beat)]):
                            self._sent_at = time.monotonic()
                        # (else not connected yet, or the link is down: the timeout decides)
                    next_beat = now + self.interval
                due = next_beat if self.contact.is_set() else min(next_beat, next_log)
                if self.armed_at is not None:
                    due = min(due, self._silence_due(self.last_reply, self.suspect_at))
                if self.alone and self._watch_down_at is not None:
                    due = min(due, self._watch_down_at + RECONNECT_S)
                for frames in self._receive(sock, wait_ms(due)):
                    if len(frames) == 1 and self._on_message(frames[0]):
                        return
                if to_node_0 is not None and to_node_0.take_dropped():
                    self.suspect_at = time.monotonic()
                while self._to_send:
                    sock.try_send([self._to_send.pop(0)])
                if self._watch_link is not None:
                    if self._from_watcher(self._watch_link.pending()):
                        return
                    self._watch_link_lost(time.monotonic())
                if self.refused is None and not self.contact.is_set() and sock.key_refused():
                    # (a node waiting for its welcome leaves with it; one that joins first hears it there too,
                    # on both sides, by address: join.py)
                    self.refused = (
                        f"node 0 at {self.endpoint} refused this node's key in the CURVE handshake: it was "
                        f"started with another secret than node 0 (give every node the same --secret-file; "
                        f"`rayfree doctor` prints the secret's fingerprint)"
                    )
                    self.welcomed.set()
                connected = sock.take_connected()
                if connected:  # (a reconnection: node 0's answer to its first beat gets the window again)
                    self.reconnected_at = time.monotonic()
                if connected or self.suspect_at != dropped:  # (re)connected, or dropped: beat now
                    dropped, next_beat = self.suspect_at, 0.0
                now = time.monotonic()
                if not self.contact.is_set() and now >= next_log:
                    logger.warning(
                        "node %d: still waiting for the leader (node 0) to answer at %s after %.0fs (the join "
                        "waits up to join_timeout_s); is node 0 started, and is that port reachable from here?",
                        self.node_rank,
                        self.endpoint,
                        now - started,
                    )
                    next_log = now + WAIT_LOG_S
                if self.armed_at is not None:
                    silent = self._silent(self.last_reply, now, self.suspect_at)
                    if silent is not None:
                        why = f"the leader at {self.endpoint}: {silent}"
                        if self.on_lost(why) is not True:  # (it says what that costs; True: it serves on)
                            return
                        self._go_alone(why)
            if self._bye is not None and not self.alone:  # (alone: nobody it was part of a cluster with listens)
                sock.send_quietly([_encode(self._bye)])
        finally:
            self._close_watch_link()
            if to_node_0 is not None:
                sock.unfollow(to_node_0)
                to_node_0.close()
            sock.close(BYE_LINGER_MS if self._bye is not None and not self.alone else 0)  # the bye goes out first

    def _go_alone(self, why: str) -> None:
        """Node 0 is lost and this node serves on: no silence bound any more (nobody to lose), and its beats say
        `alone`, so a node 0 that answers at that address again knows it at once."""
        self.alone, self.armed_at = why, None
        if self.on_watch_lost is not None:  # (those node 0 may never have heard of: the layer above decides)
            for node, lost in list(self._children_lost.items()):
                self.on_watch_lost(node, lost)
        self._watch_link_lost(time.monotonic())

    def _follow_again(self, msg: Resumed) -> None:
        """A node 0 started again took this node back: its silence is a loss again, counted from now."""
        assert self.on_resumed is not None
        now = time.monotonic()
        self.alone, self.alone_epochs = "", {}
        self.last_reply, self.suspect_at, self.armed_at = now, None, now
        self.on_resumed(msg)

    def _status(self) -> bytes:
        if self.status_fn is None:
            return b""
        try:
            status = self.status_fn()
        except Exception:  # noqa: BLE001 - a status must never stop the heartbeats
            logger.debug("heartbeat: could not build this node's status", exc_info=True)
            return b""
        if len(status) > STATUS_MAX_BYTES:
            self._dropped(
                f"this node's status ({len(status)} bytes, over {STATUS_MAX_BYTES}): node 0 shows "
                f"only what its heartbeats say"
            )
            return b""
        return status

    def _on_message(self, payload: bytes) -> bool:
        """True when the leader said goodbye."""
        try:
            msg = _decode(payload)
        except msgspec.DecodeError as e:
            self._dropped(f"an unreadable message from the leader ({e})")
            return False
        if self.alone:  # (node 0 lost: a process answering in its place hears of it from the beats)
            if isinstance(msg, Resumed) and self.on_resumed is not None:
                self._follow_again(msg)
            return False
        if isinstance(msg, Bye):
            logger.info("node %d: the leader stopped (%s)", self.node_rank, msg.reason)
            if self.on_bye(msg.node_rank, msg.clean, msg.reason) is not True:
                return True
            self._go_alone(f"it stopped: {msg.reason}")
            return False
        if isinstance(msg, Verdict):
            self.leader_verdict = msg.reason
            return False
        if isinstance(msg, WatchBy):
            if msg.endpoint != self._watch_at:  # (a watcher's replacement listens elsewhere)
                self._close_watch_link()
                self._watch_link, self._watch_at = watch_link(msg.endpoint, self.node_rank), msg.endpoint
                self._watch_down_at = None
                self._sock.follow(self._watch_link)  # (its drop wakes this thread: see _watch_link_lost)
            return False
        if isinstance(msg, Welcome):
            self.welcome = msg
            self.welcomed.set()
            return False
        if isinstance(msg, Disowned):
            if self.on_disowned is None:
                self._dropped(f"node 0's word that it counts this node lost ({msg.reason})")
            elif not self._disowned:
                self._disowned = True
                logger.error("node %d: node 0 counts this node lost: %s", self.node_rank, msg.reason)
                self.on_disowned(msg.reason)
            return False
        if isinstance(msg, Refused):
            self.refused = msg.reason  # (the layer above says it, once, and leaves)
            self.welcomed.set()
            return False
        if isinstance(msg, WidthSet):
            if self.on_width is not None:  # (one world: the width never changes, and node 0 never says it)
                self.on_width(msg)
            return False
        if isinstance(msg, (ReplicaDown, ReplicaUp, DrainReplica, Regroup)):
            react = {
                ReplicaDown: self.on_replica_down, ReplicaUp: self.on_replica_up, Regroup: self.on_regroup
            }.get(type(msg), self.on_replica_drain)  # fmt: skip
            if react is None:
                self._dropped(f"node 0's word on DP replica {msg.dp_rank} (replicas here share one world)")
            else:
                react(msg)  # type: ignore[arg-type]
            return False
        self.last_reply = time.monotonic()
        if self._sent_at:
            self.rtt_s = self.last_reply - self._sent_at
            self.rtt_count += 1
            self.rtt_sum += self.rtt_s
            self._sent_at = 0.0
        if not self.contact.is_set():
            logger.info("node %d: the leader answers at %s", self.node_rank, self.endpoint)
            self.contact.set()
        return False


def query_status(master_addr: str, port: int, timeout: float) -> bytes:
    """Node 0's answer to a StatusQuery at master_addr:port (authenticated like every heartbeat); TimeoutError
    if none comes within `timeout` seconds."""
    return ask_node0(master_addr, port, StatusQuery(), timeout)


def ask_node0(
    master_addr: str, port: int, msg: StatusQuery | DrainReplica, timeout: float, who: str = "node 0"
) -> bytes:
    """Node 0's answer to `msg` (`rayfree status`, `rayfree drain`), as query_status; or, at another address
    (`who`), a node's that serves on without node 0 (cluster/status_desk.py)."""
    sock = ControlSocket.connect(tcp_endpoint(master_addr, port), maxmsgsize=64 << 20)
    try:
        reply = sock.request(_encode(msg), timeout)
        if reply is None:
            lost = (" (if node 0 is lost, a replica's leader that serves on without it answers for itself: "
                    "rayfree status --ask ITS_ADDRESS)") if who == "node 0" else ""  # fmt: skip
            raise TimeoutError(
                f"{who} did not answer at {tcp_endpoint(master_addr, port)} within {timeout:.0f}s: "
                f"is the cluster running, is that its heartbeat port (master_port + 1, or "
                f"heartbeat_port), and does this machine hold the cluster's secret?{lost}"
            )
        return reply
    finally:
        sock.close()
