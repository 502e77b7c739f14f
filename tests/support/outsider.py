"""An outsider on the cluster's network: connects to every TCP endpoint it is given, without the secret.

    python -m tests.support.outsider '{"pub": [...], "router": [...], "server_key": "...", "seconds": 3}'

For each endpoint it tries with no CURVE at all and with a random CURVE key (given the real server
public key, as if it had learned it): SUB sockets to the publishers (also claiming to be reader 0,
without its admission token), DEALER sockets that send forged heartbeat goodbyes to the leader's
heartbeat endpoint. Prints one JSON line: bytes received, handshakes that succeeded (per kind of
endpoint), and handshakes that failed.
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message


def main() -> None:
    spec = json.loads(sys.argv[1])
    ctx = zmq.Context()
    socks, monitors = [], []
    server_key = spec["server_key"].encode()
    for kind, endpoints in (("pub", spec["pub"]), ("router", spec["router"])):
        for ep in endpoints:
            for with_key in (False, True):
                s = ctx.socket(zmq.SUB if kind == "pub" else zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                if with_key:
                    pub, sec = zmq.curve_keypair()
                    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key, pub, sec
                if kind == "pub":
                    s.setsockopt(zmq.SUBSCRIBE, b"")
                    s.setsockopt(zmq.SUBSCRIBE, b"\x00rayfree-hello:0")  # pretend to be reader 0
                monitors.append(
                    s.get_monitor_socket(
                        zmq.EVENT_HANDSHAKE_SUCCEEDED
                        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        | zmq.EVENT_DISCONNECTED
                    )
                )
                s.connect(ep)
                socks.append((kind, s))
    print("STARTED", flush=True)
    got = ok = failed = sent = 0
    ok_by_kind = {"pub": 0, "router": 0}
    kind_of = {m: kind for m, (kind, _) in zip(monitors, socks)}
    bye = msgspec.msgpack.encode(["bye", 1, False, "forged by an outsider"])
    beat = msgspec.msgpack.encode(["beat", 1, [2, 3], "10.6.6.6", 1, 1])
    end = time.monotonic() + spec["seconds"]
    poller = zmq.Poller()
    for _, s in socks:
        poller.register(s, zmq.POLLIN)
    for m in monitors:
        poller.register(m, zmq.POLLIN)
    while time.monotonic() < end:
        for kind, s in socks:
            if kind == "router":
                for msg in (bye, beat):
                    try:
                        s.send(msg, zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        pass
        for sock, _ in poller.poll(100):
            if sock in monitors:
                ev = recv_monitor_message(sock)["event"]
                if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    ok += 1
                    ok_by_kind[kind_of[sock]] += 1
                elif ev != zmq.EVENT_DISCONNECTED:
                    failed += 1
            else:
                while True:
                    try:
                        got += sum(len(f) for f in sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
    for _, s in socks:
        s.disable_monitor()
        s.close(linger=0)
    for m in monitors:
        m.close(linger=0)
    ctx.term()
    print(
        "REPORT:"
        + json.dumps(
            {
                "received_bytes": got,
                "handshakes_ok": ok,
                "handshakes_failed": failed,
                "handshakes_ok_pub": ok_by_kind["pub"],
                "handshakes_ok_router": ok_by_kind["router"],
                "sockets": len(socks),
                "queued_sends": sent,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
