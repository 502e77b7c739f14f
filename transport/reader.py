"""`QueueReader`: one reader's side of a MessageQueue — attaching from a handle, the handshake, dequeue.

A local reader maps the ring and subscribes to its ipc overflow socket
(which also carries READY and CLOSE); a remote reader subscribes to the
writer's TCP publisher. Either way the reader talks to one `Receiver`.
"""

from __future__ import annotations

from typing import Any

from . import heap, security
from .aead import Opener, admission_token, queue_key
from .errors import BadFrame, QueueTimeout
from .handle import Handle
from .ring import EMPTY
from .shm_channel import ShmReceiver
from .shm_ring import ShmRingBuffer
from .sockets import HELLO_PREFIX, make_subscriber
from .zmq_channel import READY, SocketReceiver

__all__ = ["QueueReader"]


class QueueReader:
    """Reader `rank` of the queue `handle` names; built by `MessageQueue.create_from_handle`."""

    def __init__(self, handle: Handle, rank: int, spin_us: float | None, zero_copy: bool = False) -> None:
        self.rank = rank
        self.ring: ShmRingBuffer | None = None
        self.shm: ShmReceiver | None = None
        self.sock: SocketReceiver | None = None
        limit = None if handle.max_message_bytes is None else handle.max_message_bytes + 65536
        hello = str(rank).encode()
        try:
            if rank in handle.local_reader_ranks:
                self.ring = ShmRingBuffer.attach(handle.shm_name, handle.shm_size, handle.queue_id)
                # The wake pipes first: the writer removes their directory once every hello has arrived.
                self.shm = ShmReceiver(self.ring, handle.local_reader_ranks.index(rank), spin_us, handle.ipc_dir,
                                       zero_copy)
                sub = make_subscriber(handle.local_endpoint, hello, maxmsgsize=limit)
                self.sock = self.shm.overflow = SocketReceiver(sub, "ipc")
            else:
                heap.keep_received_memory_warm()
                opener = None
                secret = security.process_secret()
                if secret is not None:  # a sealed queue: open every message, show the admission token
                    qid = bytes.fromhex(handle.queue_id)
                    opener = Opener(queue_key(secret.derive(b"queue-aead"), qid), qid)
                    hello += b":" + admission_token(secret.derive(b"queue-admit"), qid, rank)
                sub = make_subscriber(handle.remote_endpoint, hello, maxmsgsize=limit)
                self.sock = SocketReceiver(sub, "tcp", HELLO_PREFIX + hello, opener)
                self._endpoint = handle.remote_endpoint
        except BaseException:
            self.close()
            raise
        #: the receiver every message comes through
        self.receiver = self.shm if self.shm is not None else self.sock
        #: reads the ring (else a TCP subscription)
        self.is_local = self.shm is not None
        if self.shm is not None:
            self._get_one = self.shm.rr.get_one

    def handshake(self, deadline: float | None, timeout: float | None) -> None:
        """Wait for the writer's READY (it comes once every reader is attached)."""
        assert self.sock is not None
        what = f"reader rank {self.rank} waiting for the writer's READY"
        try:
            parts = self.sock.recv_frames(deadline, True, what)
        except QueueTimeout:
            raise QueueTimeout(f"{what}: nothing within {timeout}s; is the writer calling "
                               f"wait_until_ready()?") from None
        if len(parts) != 1 or parts[0] != READY:
            raise BadFrame(f"{what}: expected READY, got {len(parts)} frame(s) starting {bytes(parts[0][:16])!r}")
        if not self.is_local:
            self.sock.watch_link(self._endpoint)

    def fast_dequeue(self) -> Any:
        """The `dequeue` for this reader's path (bound into the facade once the queue is ready)."""
        return self._dequeue_shm if self.shm is not None else self.dequeue

    def _dequeue_shm(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        obj = self._get_one()
        if obj is not EMPTY:
            return obj
        return self.shm.recv(None if timeout is None else max(0.0, timeout), indefinite)

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        return self.receiver.recv(None if timeout is None else max(0.0, timeout), indefinite)

    def shutdown(self) -> None:
        if self.shm is not None:
            self.shm.shutdown()
        elif self.sock is not None:
            self.sock.shutdown()

    @property
    def waiters(self) -> list:
        return [r.waiters for r in (self.shm, self.sock) if r is not None]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if self.sock is not None:
            self.sock.close()
        self.shm = self.sock = None
        if self.ring is not None:
            self.ring.close()
