"""An HTTP server of the node (the health probes, the metrics), served from one supervised thread until `close`."""

from __future__ import annotations

import os
import select
import socketserver

from rayfree.supervisor import supervisor

__all__ = ["Served"]


class Served:
    """Answer `server`'s requests on a thread named `name` until `close()`: it waits on the listening socket and a
    wake pipe, so it costs nothing while idle and closes at once (socketserver's own loop wakes twice a second and
    takes up to half a second to stop)."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        self._wake_r, self._wake_w = os.pipe()
        self._thread = supervisor().start(name, self._serve)

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.server, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            self.server.handle_request()

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(2.0)
        self.server.server_close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    shutdown = close
