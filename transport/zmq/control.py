"""A socket for small control messages (the cluster's heartbeats, a status query), with its one error translation.

The cluster layer speaks through `ControlSocket` and never holds a ZeroMQ
socket: `listen` binds a ROUTER (each message comes with its sender's
identity), `connect` a DEALER (reconnecting by itself). Sends never block
(a peer whose queue is full is not reading, and its own timeout will tell
it); `receive` waits up to a slice for messages and notes dropped and
(re)made connections, which the heartbeats treat as a reason to suspect
their peer, and to beat at once. Both ends ping each other in libzmq's I/O
thread (sockets.py, `_link_heartbeats`), so a peer that is killed, stopped or
cut off drops its connection within RAYFREE_LINK_TIMEOUT_S whether or not
any Python thread gets the interpreter in time. `wake` (from any thread) ends
the owner's current `receive` at once: a stop needs no polling slice.
"""

from __future__ import annotations

import errno
import logging
import struct
import time

import zmq

from .sockets import SocketError, make_dealer, make_router, zmq_errors
from .waker import Waker

__all__ = ["ControlSocket"]


_SENT, _FULL, _GONE = 0, 1, 2
logger = logging.getLogger("rayfree.security")
#: handshakes closed by the peer in a row, none made, before a connecting side calls its key refused (a CURVE
#: server that cannot read a client's hello, one with another secret, closes the connection without a word)
_REFUSED_AFTER = 3
#: libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: a CURVE hello the server could not open (another secret)
_CRYPTOGRAPHIC = 0x11000001
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_REFUSED_LOG_S = 10.0
#: the errors of a handshake the peer closed (a CURVE server that could not open this side's hello)
_CLOSED = (errno.EPIPE, errno.ECONNRESET)


def _event(frame: bytes) -> tuple[int, int]:
    return struct.unpack_from("=HI", frame)  # type: ignore[return-value]


class ControlSocket:
    """One ROUTER or DEALER and a monitor of its dropped connections; used by one thread at a time."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        self._sock = sock
        self.endpoint = endpoint
        #: a connection dropped (or was made) since `take_dropped` (`take_connected`) last looked
        self._dropped = False
        self._connected = False
        #: handshakes failed since the last one made, and whether the peer refused this side's key outright
        self._failed_handshakes = 0
        self._key_refused = False
        self._refused_logged_at = -_REFUSED_LOG_S
        self._monitor: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._again = zmq_errors(f"a control message at {endpoint}", again=True)
        self._quiet = zmq_errors("", ignore=True)
        self._waker = Waker()
        #: other sockets of the same thread whose connection events end this one's `receive` too (`follow`)
        self._followed: list[ControlSocket] = []

    @classmethod
    def listen(cls, endpoint: str, pings: bool = True) -> ControlSocket:
        """A ROUTER bound to `endpoint` (a busy port is a clear error, raised here; port 0: one the system picks,
        which `endpoint` then names). `pings=False`: it sends none, and holds each connection to its peer's."""
        sock, bound = make_router(endpoint, pings=pings), endpoint
        if endpoint.endswith(":0"):
            with zmq_errors(f"reading where {endpoint} is bound"):
                bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return cls(sock, bound)

    @classmethod
    def connect(
        cls, endpoint: str, maxmsgsize: int = 1 << 16, link_timeout_s: float | None = None, routing_id: bytes = b""
    ) -> ControlSocket:
        """A DEALER (see sockets.make_dealer for `link_timeout_s` and `routing_id`)."""
        sock = make_dealer(endpoint, maxmsgsize=maxmsgsize, link_timeout_s=link_timeout_s, routing_id=routing_id)
        return cls(sock, endpoint)

    def pending(self) -> list[list[bytes]]:
        """What arrived, read without waiting (a link whose owner waits on another socket: `follow`)."""
        got: list[list[bytes]] = []
        while True:
            with self._quiet:
                got.append(self._sock.recv_multipart(zmq.NOBLOCK))
                continue
            break
        return got

    def watch(self) -> None:
        """Start noting dropped connections (from the thread that will use the socket)."""
        with zmq_errors(f"watching {self.endpoint}"):
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
            )
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._poller.register(self._waker.fd, zmq.POLLIN)

    def follow(self, other: ControlSocket) -> None:
        """Note `other`'s dropped and made connections in this socket's `receive` too (a thread that owns a second
        link waits on both at once); `unfollow` before closing `other`."""
        other.watch()
        if self._poller is None:
            self.watch()
        assert self._poller is not None and other._monitor is not None
        self._poller.register(other._monitor, zmq.POLLIN)
        self._followed.append(other)

    def unfollow(self, other: ControlSocket) -> None:
        if other in self._followed and self._poller is not None and other._monitor is not None:
            self._poller.unregister(other._monitor)
        self._followed = [o for o in self._followed if o is not other]

    def wake(self) -> None:
        """End the owner's `receive` now (any thread; a no-op once the socket is closed)."""
        self._waker.wake()

    def try_send(self, frames: list[bytes]) -> bool:
        """Now or not at all (False: the peer's queue is full, it is not connected yet, or its connection is gone)."""
        return self._send(frames) == _SENT

    def reachable(self, frames: list[bytes]) -> bool:
        """Try to send `frames`; False only when a ROUTER's peer `frames[0]` has no connection any more."""
        return self._send(frames) != _GONE

    def _send(self, frames: list[bytes]) -> int:
        try:
            with self._again:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return _SENT
        except SocketError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return _GONE
            raise
        return _FULL

    def send_quietly(self, frames: list[bytes]) -> None:
        """A best-effort message on the way out (a goodbye): any error is ignored."""
        with self._quiet:
            self._sock.send_multipart(frames, zmq.NOBLOCK)

    def receive(self, wait_ms: int) -> list[list[bytes]]:
        """The messages that arrive within `wait_ms` (all that are there once one is)."""
        got: list[list[bytes]] = []
        if self._poller is None:
            self.watch()
        assert self._poller is not None and self._monitor is not None
        with zmq_errors(f"receiving at {self.endpoint}"):
            events = dict(self._poller.poll(wait_ms))
        if self._waker.fd in events:
            self._waker.drain()
        for s in (self, *self._followed):
            if s._monitor in events:
                s._take_events()
        if self._sock in events:
            while True:
                with self._again:
                    got.append(self._sock.recv_multipart(zmq.NOBLOCK))
                    continue
                break
        return got

    def _take_events(self) -> None:
        assert self._monitor is not None
        while True:
            with self._again:
                event = self._monitor.recv_multipart(zmq.NOBLOCK)  # [event id + value, endpoint]
                self._on_event(*_event(event[0]))
                continue
            break

    def _on_event(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_DISCONNECTED:
            self._dropped = True
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected, self._failed_handshakes = True, 0
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # (the peer's ZAP handler refused this side's key)
            self._key_refused = True
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _CLOSED:  # (the peer closed it mid-way,
            self._failed_handshakes += 1  # not a slow peer's timeout)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _CRYPTOGRAPHIC:
            now = time.monotonic()  # (a listening side: a peer's hello it could not open; one line per 10 s)
            if now - self._refused_logged_at >= _REFUSED_LOG_S:
                self._refused_logged_at = now
                logger.warning(
                    "%s: refused a connection whose CURVE handshake failed: its peer does not hold this "
                    "cluster's secret (start it with the same --secret-file; `rayfree doctor` prints each "
                    "secret's fingerprint)",
                    self.endpoint,
                )

    def key_refused(self) -> bool:
        """A connecting side: did the peer refuse this side's key (its ZAP handler said no, or it closed
        `_REFUSED_AFTER` handshakes in a row, none made: a CURVE server with another secret)?"""
        return self._key_refused or self._failed_handshakes >= _REFUSED_AFTER

    def take_dropped(self) -> bool:
        """Did a connection drop since the last look?"""
        dropped, self._dropped = self._dropped, False
        return dropped

    def take_connected(self) -> bool:
        """Was a connection made (its handshake done) since the last look?"""
        connected, self._connected = self._connected, False
        return connected

    def request(self, payload: bytes, timeout: float) -> bytes | None:
        """Send `payload`, wait up to `timeout` seconds for one answer (None if none came)."""
        with zmq_errors(f"asking {self.endpoint}"):
            self._sock.send(payload)
            if not self._sock.poll(int(timeout * 1000)):
                return None
            return self._sock.recv()

    def close(self, linger_ms: int = 0) -> None:
        if self._monitor is not None:
            with self._quiet:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=linger_ms)
        self._waker.close()
