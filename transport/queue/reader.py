"""`QueueReader`: one reader's side of a MessageQueue — attaching from a handle, the handshake, dequeue.

A local reader maps the ring and subscribes to its ipc overflow socket
(which also carries READY and CLOSE); a remote reader subscribes to the
writer's TCP publisher. Either way the reader holds one `Receiver`.
"""

from __future__ import annotations

from ..channel import Receiver, Waiters
from ..errors import BadFrame, QueueTimeout
from ..shm.receiver import ShmReceiver
from ..zmq import heap
from ..zmq.receiver import SocketReceiver
from ..zmq.sender import READY
from .handle import Handle

__all__ = ["QueueReader"]


class QueueReader:
    """Reader `rank` of the queue `handle` names; built by `MessageQueue.create_from_handle`."""

    def __init__(self, handle: Handle, rank: int, spin_us: float | None, zero_copy: bool = False) -> None:
        self.rank = rank
        limit = None if handle.max_message_bytes is None else handle.max_message_bytes + 65536
        #: reads the ring (else a TCP subscription)
        self.is_local = rank in handle.local_reader_ranks
        self.receiver: Receiver
        if self.is_local:
            assert handle.shm_name and handle.ipc_dir and handle.local_endpoint
            self.receiver = ShmReceiver.attach(
                handle.shm_name,
                handle.shm_size,
                handle.queue_id,
                handle.local_reader_ranks.index(rank),
                handle.ipc_dir,
                handle.local_endpoint,
                rank,
                spin_us,
                zero_copy,
                limit,
            )
        else:
            assert handle.remote_endpoint
            heap.keep_received_memory_warm()
            self.receiver = SocketReceiver.subscribe(handle.remote_endpoint, "tcp", rank, handle.queue_id, limit)
        self._endpoint = handle.remote_endpoint or ""
        self._closed = False

    def handshake(self, deadline: float | None, timeout: float | None) -> None:
        """Wait for the writer's READY (it comes once every reader is attached)."""
        what = f"reader rank {self.rank} waiting for the writer's READY"
        r = self.receiver
        assert isinstance(r, (ShmReceiver, SocketReceiver))
        try:
            parts = r.recv_control(deadline, what)
        except QueueTimeout:
            raise QueueTimeout(
                f"{what}: nothing within {timeout}s; is the writer calling wait_until_ready()?"
            ) from None
        if len(parts) != 1 or parts[0] != READY:
            raise BadFrame(f"{what}: expected READY, got {len(parts)} frame(s) starting {bytes(parts[0][:16])!r}")
        if isinstance(r, SocketReceiver):
            r.watch_link(self._endpoint)

    def shutdown(self) -> None:
        if not self._closed:
            self.receiver.shutdown()

    @property
    def waiters(self) -> list[Waiters]:
        r = self.receiver
        return [r.waiters, r.overflow.waiters] if isinstance(r, ShmReceiver) else [r.waiters]

    @property
    def bad_frames(self) -> int:
        """Messages that could not be parsed, reported and skipped (a socket path's count)."""
        r = self.receiver
        return (r.overflow if isinstance(r, ShmReceiver) else r).bad_frames  # type: ignore[union-attr]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.receiver.close()
