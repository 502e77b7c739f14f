"""A follower node 0 watches itself, with the watch on: it beats over a link that pings (RAYFREE_LINK_TIMEOUT_S)
and, with --link, also holds the ping-only link to node 0 (heartbeat_links.py). Once node 0 answered a few beats
and both links have pinged for a while, it beats once more and waits for that answer (so the beat, a data frame,
is the last thing node 0 got on its beat link), prints STOPPING and stops itself (SIGSTOP): node 0's bound on
the beat link is disarmed until a ping that never comes.

    python -m tests.support.beat_then_stop PORT [--link]
"""

from __future__ import annotations

import os
import signal
import sys
import time

from rayfree.cluster.heartbeat_messages import Beat, _decode, _encode
from rayfree.cluster.watch import watch_link
from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket


def _beat_until_answered(sock: ControlSocket, seq: int) -> bool:
    sock.try_send([_encode(Beat(1, [1], "127.0.0.1", os.getpid(), seq, shape="tp=1", incarnation=3))])
    return any(len(f) == 1 and isinstance(_decode(f[0]), Beat) for f in sock.receive(200))


def main() -> int:
    endpoint = tcp_endpoint("127.0.0.1", int(sys.argv[1]))
    sock = ControlSocket.connect(endpoint)
    link = watch_link(endpoint, 1) if "--link" in sys.argv else None
    answered, seq, deadline = 0, 0, time.monotonic() + 30
    while answered < 4 and time.monotonic() < deadline:
        seq += 1
        answered += _beat_until_answered(sock, seq)
    until = time.monotonic() + 0.5  # (both links ping a few times: node 0 holds each to their TTL)
    while time.monotonic() < until:
        sock.receive(50)
    while not _beat_until_answered(sock, seq + 1) and time.monotonic() < deadline:
        seq += 1
    print("STOPPING", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    sock.close()
    if link is not None:
        link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
