"""A beat of node N's earlier incarnation (its old pid), sent with the cluster's secret to node 0's heartbeats, as
the old process would once it resumed: node 0 must refuse it. Prints SENT:{...} once some beats went out.

    python -m tests.support.stale_beat MASTER_ADDR HEARTBEAT_PORT NODE OLD_PID
"""

from __future__ import annotations

import json
import sys
import time

from rayfree.cluster.heartbeat_messages import Beat, _encode
from rayfree.transport.net import tcp_endpoint
from rayfree.transport.zmq.control import ControlSocket


def main() -> int:
    addr, port, node, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sock = ControlSocket.connect(tcp_endpoint(addr, port))
    sent, deadline = 0, time.monotonic() + 30
    try:
        while sent < 3 and time.monotonic() < deadline:
            sent += sock.try_send([_encode(Beat(node, [node], "stale", pid, 1 + sent))])
            sock.receive(100)  # (node 0 answers nothing to it)
    finally:
        sock.close()
    print("SENT:" + json.dumps({"beats": sent}), flush=True)
    return 0 if sent else 1


if __name__ == "__main__":
    sys.exit(main())
