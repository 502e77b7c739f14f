"""A socket for small control messages (the cluster's heartbeats, a status query), with its one error translation.

The cluster layer speaks through `ControlSocket` and never holds a ZeroMQ
socket: `listen` binds a ROUTER (each message comes with its sender's
identity), `connect` a DEALER (reconnecting by itself). Sends never block
(a peer whose queue is full is not reading, and its own timeout will tell
it); `receive` waits up to a slice for messages and notes dropped
connections, which the heartbeats treat as a reason to suspect their peer.
"""

from __future__ import annotations

import zmq

from rayfree.transport.zmq.sockets import make_dealer, make_router, zmq_errors

__all__ = ["ControlSocket"]


class ControlSocket:
    """One ROUTER or DEALER and a monitor of its dropped connections; used by one thread at a time."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        self._sock = sock
        self.endpoint = endpoint
        #: a connection dropped since `take_dropped` last looked
        self._dropped = False
        self._monitor: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._again = zmq_errors(f"a control message at {endpoint}", again=True)
        self._quiet = zmq_errors("", ignore=True)

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
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)

    def try_send(self, frames: list[bytes]) -> bool:
        """Now or not at all (False: the peer's queue is full, or it is not connected yet)."""
        with self._again:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        return False

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
        if self._monitor in events:
            while True:
                with self._again:
                    self._monitor.recv_multipart(zmq.NOBLOCK)  # [event, endpoint]: which one does not matter
                    self._dropped = True
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
