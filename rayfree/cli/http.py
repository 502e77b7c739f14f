"""An HTTP server of the node (the health probes, the metrics), served from one supervised thread until `close`."""

from __future__ import annotations

import logging
import os
import select
import socketserver
import sys

from rayfree.supervisor import Supervised, supervisor

__all__ = ["Served"]

logger = logging.getLogger("rayfree.node")


class Served:
    """Answer `server`'s requests on a thread named `name` until `close()`: it waits on the listening socket and a
    wake pipe, so it costs nothing while idle and closes at once (socketserver's own loop wakes twice a second and
    takes up to half a second to stop)."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        self._name = name
        server.handle_error = self._handle_error  # type: ignore[method-assign]
        self._wake_r, self._wake_w = os.pipe()
        self._thread: Supervised | None = None

    def start(self) -> Served:
        """Start answering (built, then started)."""
        self._thread = supervisor().start(self._name, self._serve)
        return self

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.server, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            self.server.handle_request()

    def _handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up before its answer (a probe's timeout, a load balancer) is no error; anything else
        is logged in one line, not printed as a traceback into the node's log."""
        e = sys.exc_info()[1]
        if isinstance(e, ConnectionError):
            logger.debug("%s: %s left before its answer: %s", self._name, client_address, e)
            return
        logger.warning("%s: a request from %s failed: %s: %s", self._name, client_address, type(e).__name__, e)

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(2.0)
        self.server.server_close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    shutdown = close
