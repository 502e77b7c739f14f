"""`rayfree node --health-port`: GET /livez and /readyz for Kubernetes probes and load balancers.

Plain HTTP from the standard library, no optional dependency; each answer is
200 or 503 with one line of JSON saying why (executor/health.py judges). The
server starts before the workers, so a liveness probe sees a node that is
still loading its model as alive, and readiness as "starting".
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rayfree.executor import health

from .http import Served

__all__ = ["HealthServer"]

logger = logging.getLogger("rayfree.node")


class HealthServer:
    """Answers the probes for this node; `liveness` is set once the node's liveness exists."""

    def __init__(self, port: int, node: int) -> None:
        self.node = node
        self.liveness: Any = None
        #: why this node is stopping, once it is (/readyz answers 503 while it shuts down; /livez 200)
        self.stopping = ""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                path = self.path.split("?", 1)[0]
                if path not in ("/livez", "/readyz"):
                    self._answer(404, {"error": f"no {path}: use /livez or /readyz"})
                    return
                why = owner.judge(path == "/readyz")
                body = {"ok": not why, "node": owner.node}
                if why:
                    body["reason"] = why
                self._answer(503 if why else 200, body)

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = (json.dumps(body) + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes every few seconds: quiet
                return

        self._server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        self._server.daemon_threads = True
        self._served = Served(self._server, "RayfreeHealth").start()
        logger.info("node %d: health probes at http://0.0.0.0:%d/livez and /readyz", node, port)

    def judge(self, readiness: bool) -> str:
        try:
            if not readiness:  # alive until the process is gone, stopping included (it leaves by itself)
                return health.alive(self.liveness)
            if self.stopping:
                return f"node {self.node} is stopping: {self.stopping}"
            return health.ready(self.liveness)
        except Exception as e:  # noqa: BLE001 - a probe must answer, and a broken check is not "ready"
            logger.debug("health check failed", exc_info=True)
            return f"the health check itself failed: {type(e).__name__}: {e}"

    def close(self) -> None:
        self._served.close()
