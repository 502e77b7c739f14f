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

import struct

import zmq

from .sockets import SocketError, make_dealer, make_router, zmq_errors
from .waker import Waker

__all__ = ["ControlSocket"]


_SENT, _FULL, _GONE = 0, 1, 2


def _event_id(frame: bytes) -> int:
    return int(struct.unpack_from("=H", frame)[0])


class ControlSocket:
    """One ROUTER or DEALER and a monitor of its dropped connections; used by one thread at a time."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        self._sock = sock
        self.endpoint = endpoint
        #: a connection dropped (or was made) since `take_dropped` (`take_connected`) last looked
        self._dropped = False
        self._connected = False
        self._monitor: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._again = zmq_errors(f"a control message at {endpoint}", again=True)
        self._quiet = zmq_errors("", ignore=True)
        self._waker = Waker()

    @classmethod
    def listen(cls, endpoint: str) -> ControlSocket:
        """A ROUTER bound to `endpoint` (a busy port is a clear error, raised here)."""
        return cls(make_router(endpoint), endpoint)

    @classmethod
    def connect(cls, endpoint: str, maxmsgsize: int = 1 << 16) -> ControlSocket:
        return cls(make_dealer(endpoint, maxmsgsize=maxmsgsize), endpoint)

    def watch(self) -> None:
        """Start noting dropped connections (from the thread that will use the socket)."""
        with zmq_errors(f"watching {self.endpoint}"):
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._poller.register(self._waker.fd, zmq.POLLIN)

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
        if self._monitor in events:
            while True:
                with self._again:
                    event = self._monitor.recv_multipart(zmq.NOBLOCK)  # [event id + value, endpoint]
                    if _event_id(event[0]) == zmq.EVENT_DISCONNECTED:
                        self._dropped = True
                    else:
                        self._connected = True
                    continue
                break
        if self._sock in events:
            while True:
                with self._again:
                    got.append(self._sock.recv_multipart(zmq.NOBLOCK))
                    continue
                break
        return got

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
