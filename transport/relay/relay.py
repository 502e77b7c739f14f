"""`Relay`: a follower node's one stream in from its parent, into this node's ring and on to its child nodes.

A broadcast then leaves node 0 once per node it feeds (not once per remote
rank), and a sealed one is opened once per node. The relay is three channels
of the rooms below and a thread between them: a `SocketReceiver` subscribed to
the parent (node 0's queue, or the parent's relay), a `ShmSender` ring that
this node's ranks read as any local readers do, and (with child nodes) a
`SocketSender` that passes each wire message on unchanged, as soon as it
arrived: sealed or with its sequence number, so every node checks it against
node 0's key and numbers, and the first writer's READY and CLOSE reach the
whole tree. The thread forwards first, then opens, then writes the ring.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from rayfree import settings
from rayfree.supervisor import Supervised, supervisor

from ..errors import BadFrame, QueueShutdown, QueueTimeout
from ..net import tcp_endpoint
from ..queue.handle import Handle
from ..queue.writer import REMOTE_SNDHWM
from ..shm.segment import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
from ..shm.sender import ShmSender
from ..zmq import heap, lingering
from ..zmq.receiver import SocketReceiver
from ..zmq.sender import CLOSE, CTRL, READY, SocketSender

__all__ = ["Relay"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter
#: the relay's thread looks for shutdown this often while it waits
_SLICE_S = 0.1


class Relay:
    """This node's relay (see the module docstring). `handle` is the ring's, for this node's `n_local` ranks
    (reader ranks 0..n_local-1); `endpoint` is where child nodes subscribe (None without children)."""

    def __init__(
        self,
        n_local: int,
        relay_id: int,
        children: list[int],
        connect_ip: str,
        *,
        timeout_s: float,
        spin_us: float | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        on_broken: Callable[[Exception], None] | None = None,
    ) -> None:
        self.relay_id = relay_id
        self.children = list(children)
        self.timeout_s = timeout_s
        self.on_broken = on_broken
        #: why the relay stopped before its writer closed (None while it runs, or after a clean end)
        self.failure: Exception | None = None
        self.relayed = 0
        self.relayed_bytes = 0
        self.skipped = 0
        self.parent_endpoint: str | None = None
        self._up: SocketReceiver | None = None
        self._upstream: tuple[Handle, str] | None = None
        self._connected = threading.Event()
        self._stopping = False
        self._closed = False
        self._ended = False  # the writer's CLOSE came: the ring and the children were told
        queue_id = secrets.token_bytes(16)
        self.ring = ShmSender.create(list(range(n_local)), max_chunk_bytes, max_chunks, queue_id, spin_us)
        self.out: SocketSender | None = None
        try:
            if children:
                self.out = SocketSender.publish(tcp_endpoint(connect_ip, "*"), "tcp", self.children, REMOTE_SNDHWM, b"")
        except BaseException:
            self.ring.abort()
            raise
        self.endpoint = self.out.endpoint if self.out is not None else None
        # the child nodes subscribe to the same stream, passed on, at `endpoint`
        self.handle = Handle.for_writer(
            queue_id, n_local, list(range(n_local)), self.ring.names(), max_chunk_bytes, max_chunks, self.endpoint
        )
        self._thread: Supervised | None = None

    def start(self) -> Relay:
        """Start the relay's thread (built, then started: its owner wires `on_broken` and the rest first)."""
        self._thread = supervisor().start(f"RayfreeRelay-{self.relay_id}", self._run, stop=self._shut_channels)
        return self

    # -- the stream in ----------------------------------------------------------------------------

    def connect(self, upstream: Handle, endpoint: str) -> None:
        """Subscribe to `endpoint` (node 0's publisher, or the parent node's relay), which carries the queue
        `upstream` names; the relay's thread does it (it owns every socket of the relay)."""
        if self._upstream is None:
            self._upstream = (upstream, endpoint)
            self.parent_endpoint = endpoint
            self._connected.set()

    def _run(self) -> None:
        deadline = _perf() + self.timeout_s
        try:
            self._handshake(self.ring.overflow, set(self.ring.readers), deadline, "this node's ranks", READY)
            while not self._connected.wait(_SLICE_S):
                self._check(deadline, "nobody told this relay where its stream comes from")
            assert self._upstream is not None
            handle, endpoint = self._upstream
            heap.keep_received_memory_warm()
            up = self._up = SocketReceiver.subscribe(endpoint, "tcp", self.relay_id, handle.queue_id, None)
            if self._stopping:
                raise QueueShutdown("closed")
            if self.out is not None:
                self.out.admit_to(bytes.fromhex(handle.queue_id))
                self._handshake(self.out, set(self.children), deadline, "its child nodes", None)
            self._pump(up)
        except QueueShutdown:
            pass  # closing
        except Exception as e:  # noqa: BLE001 - the node's executor decides what a broken relay means
            if not self._stopping:
                self.failure = e
                logger.error("relay %d: %s: %s", self.relay_id, type(e).__name__, e)
                if self.on_broken is not None:
                    self.on_broken(e)

    def _check(self, deadline: float, why: str) -> None:
        if self._stopping:
            raise QueueShutdown("closed")
        if _perf() >= deadline:
            raise QueueTimeout(f"relay {self.relay_id}: {why} within {self.timeout_s:.0f}s")

    def _handshake(self, sender: SocketSender, missing: set[int], deadline: float, who: str, ready: bytes | None):
        """Wait for the hellos of `missing` on `sender`; then `ready` (the ring's own READY; the children get
        their writer's, passed on)."""

        def attempt(wait_s: float) -> bool | None:
            if self._stopping:
                raise QueueShutdown("closed")
            sender.take_hellos(missing, wait_s)
            return None if missing else True

        sender.wait(
            attempt,
            deadline,
            f"relay {self.relay_id} waiting for {who}",
            lambda _: f": reader(s) {sorted(missing)} never subscribed",
            slice_s=0.2,
            log_every=10.0,
            log=lambda w: f"relay {self.relay_id} waiting {w:.0f}s for {who}: {sorted(missing)}",
        )
        if ready is not None:
            self.ring.remove_names()  # every local reader has mapped the ring
            sender.send_control(ready, block=True)

    def _pump(self, up: SocketReceiver) -> None:
        """Forward, open, write the ring: until the writer's CLOSE (or shutdown, or a broken stream)."""
        out, ring = self.out, self.ring
        what = f"relay {self.relay_id} reading from {up.endpoint}"
        ready = False
        while True:
            wire = up.recv_wire(None, what)
            if out is not None:
                out.forward([f.buffer for f in wire], None)
            try:
                plain = up.open_wire(wire)
            except BadFrame as e:
                self.skipped += 1
                logger.warning("%s: skipped a message that cannot be parsed (%s); %d so far", what, e, self.skipped)
                continue
            if plain is None:
                continue  # a segment of a sealed message; its rest is on its way
            first = plain[0]
            if first[:4] == CTRL:
                if first == CLOSE:
                    self._end(up)
                    return
                if first == READY and not ready:
                    ready = True
                    up.watch_link(up.endpoint)
                continue
            if not ring.try_send(plain):
                ring.send(plain, None, None)
            self.relayed += 1
            self.relayed_bytes += sum(memoryview(p).nbytes for p in plain)

    def _end(self, up: SocketReceiver) -> None:
        """The writer closed: the ring's readers and the children learn it (the children from its own CLOSE,
        passed on already), and the parent learns that this relay has everything."""
        self._ended = True
        self.ring.close()
        if self.out is not None:
            lingering.hold(self.out, self.children, settings.get("RAYFREE_CLOSE_FLUSH_S"), close_sent=True)
            self.out = None
        up.ack_close()

    # -- what a look from outside sees ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Messages and bytes relayed into the ring, bytes passed on to the children, the ring's occupancy and
        how far behind each local reader is (racy by design)."""
        out: dict[str, Any] = {
            "relayed": self.relayed,
            "relayed_bytes": self.relayed_bytes,
            "forwarded_bytes": self.out.sent_bytes if self.out is not None else 0,
            "children": self.children,
            "parent": self.parent_endpoint,
        }
        if not self._ended:
            out.update(self.ring.status())
        return out

    # -- the end ------------------------------------------------------------------------------------

    def _shut_channels(self) -> None:
        self._stopping = True
        for ch in (self._up, self.ring, self.out):
            if ch is not None:
                ch.shutdown()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and release every channel (the ring's names too); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shut_channels()
        if self._thread is not None:
            self._thread.join(timeout)  # (never from its own thread: on_broken only reports)
        if self.out is not None:
            self.out.abort()
        if not self._ended:
            self.ring.abort()
        if self._up is not None:
            self._up.close()
