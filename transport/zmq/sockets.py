"""The one place where rayfree makes ZeroMQ sockets, and where their errors are translated (`translate`).

Publishers are XPUB sockets that never drop (XPUB_NODROP: a slow subscriber
makes the writer wait, bounded by its timeout, instead of losing a message)
and that report every subscription (XPUB_VERBOSE), which is how the writer
learns which readers have arrived. Subscribers cap the size of what they
accept. With a cluster secret, a queue's TCP messages are sealed once by the
writer (aead.py) and its publisher admits subscribers by hand, on a token
derived from the secret; the heartbeat sockets are CURVE servers and clients
with keys from the secret. Without a secret no TCP socket exists unless the
user chose --insecure; ipc sockets stay in 0700 directories.
"""

from __future__ import annotations

import os
import threading

import zmq

from rayfree import settings

from ..errors import QueueTimeout, TransportError
from ..net import is_ipv6
from ..secure import policy, zap

__all__ = [
    "context",
    "make_publisher",
    "make_subscriber",
    "make_router",
    "make_dealer",
    "zmq_errors",
    "translate",
    "tracker_done",
    "SocketError",
    "HELLO_PREFIX",
]

#: Subscription topic prefix a reader adds so the writer can tell who arrived.
HELLO_PREFIX = b"\x00rayfree-hello:"

_ctx: zmq.Context | None = None
_ctx_pid = -1
_ctx_lock = threading.Lock()


def context() -> zmq.Context:
    """This process's ZeroMQ context (made anew after a fork)."""
    global _ctx, _ctx_pid
    pid = os.getpid()
    if _ctx is None or _ctx_pid != pid:
        with _ctx_lock:
            if _ctx is None or _ctx_pid != pid:
                _ctx, _ctx_pid = zmq.Context(io_threads=1), pid
    return _ctx


class SocketError(TransportError, zmq.ZMQError):
    """A ZeroMQ operation failed. Also a `zmq.ZMQError` (same errno), so code written against vLLM's
    queue, which catches that, keeps working."""

    def __init__(self, message: str, errno: int | None) -> None:
        TransportError.__init__(self, message)
        self.errno = errno
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror


def translate(e: zmq.ZMQError, what: str) -> TransportError:
    """The transport's error for ZeroMQ's `e`, saying what was being done (and what to do, where we know)."""
    if isinstance(e, zmq.Again):
        return QueueTimeout(f"{what}: timed out")
    if e.errno == zmq.EADDRINUSE:
        return SocketError(
            f"{what}: the address is already in use: another rayfree leader (or something else) "
            f"holds that port; stop it or choose another port",
            e.errno,
        )
    if e.errno == zmq.ETERM:
        return SocketError(f"{what}: this process's ZeroMQ context was terminated (the process is exiting)", e.errno)
    return SocketError(f"{what}: {e.strerror} (zmq errno {e.errno})", e.errno)


class zmq_errors:
    """Translate every ZeroMQ error raised by the raw calls inside the block (`translate`), trio's way.

    Nothing but raw socket calls belongs inside. With `again=True`, `zmq.Again` (a non-blocking call that
    could not act now, or a blocking one whose timeout ran out) is swallowed instead: the statement after
    the block runs, so ``with again: sock.send(m, NOBLOCK); return True`` then ``return False`` reads as it
    means. One instance may be kept and reused (it holds no state of a call).
    """

    __slots__ = ("what", "again", "ignore")

    def __init__(self, what: str, again: bool = False, ignore: bool = False) -> None:
        self.what = what
        self.again = again
        #: swallow every ZeroMQ error (a best-effort call on the way out: a goodbye, an unsubscribe)
        self.ignore = ignore

    def __enter__(self) -> None:
        return None

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if t is None or not issubclass(t, zmq.ZMQError):
            return False
        if self.ignore or (self.again and issubclass(t, zmq.Again)):
            return True
        assert isinstance(e, zmq.ZMQError)
        raise translate(e, self.what) from e


def tracker_done(tracker: zmq.MessageTracker, timeout: float) -> bool:
    """Wait up to `timeout` seconds for ZeroMQ to let go of a message's buffers; True once it has."""
    try:
        tracker.wait(timeout)
    except zmq.NotDone:
        return False
    return True


def _secure_server(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """A bound TCP socket: CURVE server, peers vetted by the ZAP handler."""
    if not endpoint.startswith("tcp://"):
        return
    s = policy.require_secret(what)
    if s is None:
        return
    zap.ensure_zap_handler(context(), s.client_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, zap.DOMAIN)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, s.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, s.server_public)


def _secure_client(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """A connecting TCP socket: CURVE client with the cluster's client key."""
    if not endpoint.startswith("tcp://"):
        return
    s = policy.require_secret(what)
    if s is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, s.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, s.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, s.client_secret)


def _is_tcp_v6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[") or (endpoint.startswith("tcp://") and is_ipv6(endpoint[6:].rsplit(":", 1)[0]))


def make_publisher(bind_to: str, *, sndhwm: int) -> tuple[zmq.Socket, str, bool]:
    """An XPUB bound to `bind_to` (ipc://path or tcp://host:*): it, its real endpoint, and whether it admits
    subscribers by hand (a TCP publisher with a cluster secret: its messages are sealed (aead.py), so it takes
    no CURVE, and only subscribers that show their admission token get them, see sender.py)."""
    sock = context().socket(zmq.XPUB)
    manual = False
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        if _is_tcp_v6(bind_to):
            sock.setsockopt(zmq.IPV6, 1)
        if bind_to.startswith("tcp://") and policy.require_secret("a queue with remote readers") is not None:
            sock.setsockopt(zmq.XPUB_MANUAL, 1)
            manual = True
        with zmq_errors(f"binding a publisher to {bind_to}"):
            sock.bind(bind_to)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, endpoint, manual


def make_subscriber(endpoint: str, hello: bytes, *, maxmsgsize: int | None) -> zmq.Socket:
    """A SUB connected to `endpoint`, subscribed to everything plus its hello topic (which carries its admission
    token on a sealed TCP queue: no CURVE there, see make_publisher)."""
    sock = context().socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if maxmsgsize:
            sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        if _is_tcp_v6(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        if endpoint.startswith("tcp://"):
            policy.require_secret("a remote reader")  # policy: TCP only with a secret, or --insecure
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.SUBSCRIBE, HELLO_PREFIX + hello)
        with zmq_errors(f"connecting a subscriber to {endpoint}"):
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _link_heartbeats(sock: zmq.Socket, link_timeout_s: float | None = None, *, pings: bool = True) -> None:
    """libzmq's own ZMTP pings, sent and checked by its I/O thread (no Python, no GIL): a connection that
    carries nothing for RAYFREE_LINK_TIMEOUT_S (or `link_timeout_s`; a peer killed, stopped, or cut off) is
    closed, and the socket's monitor says so. 0 leaves them off. `pings=False` (a listening side that may have
    hundreds of peers): this side sends none, answers its peers' and holds each connection to the bound its peer's
    pings carry (ZMTP's TTL), so the peer sets the pace and a listener's cost is half a pinging one's."""
    ms = int((settings.get("RAYFREE_LINK_TIMEOUT_S") if link_timeout_s is None else link_timeout_s) * 1000)
    if ms > 0 and pings:
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(10, ms // 4))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, ms)


def make_router(bind_to: str, *, maxmsgsize: int = 1 << 16, pings: bool = True) -> zmq.Socket:
    """A ROUTER bound to `bind_to` for small control messages (heartbeats); a busy port is a clear error.
    `pings=False`: its connections are held to the bound their peers' pings carry (`_link_heartbeats`)."""
    sock = context().socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        sock.setsockopt(zmq.SNDHWM, 100)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer with no connection says so (EHOSTUNREACH)
        _link_heartbeats(sock, pings=pings)
        if _is_tcp_v6(bind_to):
            sock.setsockopt(zmq.IPV6, 1)
        _secure_server(sock, bind_to, "the leader's heartbeat endpoint")
        with zmq_errors(f"binding {bind_to}"):
            sock.bind(bind_to)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def make_dealer(
    endpoint: str, *, maxmsgsize: int = 1 << 16, link_timeout_s: float | None = None, routing_id: bytes = b""
) -> zmq.Socket:
    """A DEALER connected to `endpoint` (reconnecting by itself); sends never block for long. `link_timeout_s`:
    its link's bound (None: RAYFREE_LINK_TIMEOUT_S); `routing_id`: how the ROUTER it connects to names it."""
    sock = context().socket(zmq.DEALER)
    try:
        if routing_id:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        sock.setsockopt(zmq.SNDHWM, 10)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        _link_heartbeats(sock, link_timeout_s)
        if _is_tcp_v6(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        _secure_client(sock, endpoint, "a follower's heartbeats")
        with zmq_errors(f"connecting to {endpoint}"):
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
