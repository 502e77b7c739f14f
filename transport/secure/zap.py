"""The ZAP handler: admits a CURVE peer only if its key is the one derived from the cluster secret.

ZeroMQ asks the handler (an inproc REP socket named by the ZAP spec, one per
context) about every incoming connection to a CURVE server socket. A peer
without the secret cannot hold the client key, so it is refused here (one
without the server key never completes the handshake at all).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq
import zmq.utils.z85

from rayfree.supervisor import supervisor

__all__ = ["ensure_zap_handler", "zap_socket"]

logger = logging.getLogger("rayfree.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: the zap_domain every rayfree CURVE server sets (ZeroMQ only asks ZAP for sockets that set one)
DOMAIN = b"rayfree"
_lock = threading.Lock()
_handler: tuple[int, zmq.Socket, set[bytes]] | None = None
_refused_log_at = 0.0


def zap_socket() -> zmq.Socket | None:
    """The handler's socket in this process (the tests' leak guard leaves it alone)."""
    return _handler[1] if _handler is not None and _handler[0] == os.getpid() else None


def ensure_zap_handler(context: zmq.Context, client_public_z85: bytes) -> None:
    """Start this process's handler (once per process), admitting `client_public_z85`."""
    global _handler
    key = zmq.utils.z85.decode(client_public_z85)
    with _lock:
        if _handler is not None and _handler[0] == os.getpid():
            _handler[2].add(key)
            return
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        allowed = {key}
        _handler = (os.getpid(), sock, allowed)
    supervisor().start("RayfreeZAP", _serve, args=(sock, allowed))


def _serve(sock: zmq.Socket, allowed: set[bytes]) -> None:
    while True:
        try:
            parts = sock.recv_multipart()
        except zmq.ContextTerminated:
            sock.close(linger=0)
            return
        except zmq.ZMQError:
            return
        sock.send_multipart(_answer(parts, allowed))


def _answer(parts: list[bytes], allowed: set[bytes]) -> list[bytes]:
    global _refused_log_at
    if len(parts) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
    version, request_id, domain, address, _identity, mechanism = parts[:6]
    creds = parts[6:]
    ok = domain == DOMAIN and mechanism == b"CURVE" and len(creds) == 1 and creds[0] in allowed
    if not ok:
        now = time.monotonic()
        if now - _refused_log_at > 5.0:  # one line per burst: a scanner must not flood the log
            _refused_log_at = now
            logger.warning(
                "refused a connection from %s (%s): it does not hold the cluster secret",
                address.decode(errors="replace"),
                mechanism.decode(errors="replace"),
            )
        return [version, request_id, b"400", b"not a member of this cluster", b"", b""]
    return [version, request_id, b"200", b"OK", b"", b""]
