"""`QueueWriter`: the writer's side of a MessageQueue — its paths, the handshake, enqueue, close.

Local readers are reached through the shared-memory ring (with its ipc
overflow socket), remote ones through a TCP publisher bound to `connect_ip`.
`enqueue` is chosen once the queue is ready, for the paths this writer has,
so the common case pays for no branch it does not need.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
import weakref
from typing import Any

import zmq

from rayfree import settings

from . import lingering, security, serde
from .errors import MessageTooLarge, QueueShutdown, QueueTimeout
from .framing import KIND_BYTES, KIND_DATA
from .handle import HANDLE_VERSION, Handle
from .net import IpcDir, get_ip, tcp_endpoint
from .shm_channel import ShmSender
from .shm_ring import ShmRingBuffer
from .aead import Sealer, admission_token, queue_key
from .sockets import HELLO_PREFIX, make_publisher, translate
from .zmq_channel import RAW_MAX_BYTES, READY, SocketSender, hello_rank

__all__ = ["QueueWriter", "REMOTE_SNDHWM", "deadline_of"]

logger = logging.getLogger("rayfree.transport")

#: How many messages a remote subscriber may fall behind before enqueue waits.
REMOTE_SNDHWM = 1000

_perf = time.perf_counter


def deadline_of(timeout: float | None) -> float | None:
    """A perf_counter deadline; a negative timeout counts as 0 (as vLLM's queue does)."""
    if timeout is None:
        return None
    return _perf() + max(0.0, timeout)


def _cleanup(ring: ShmRingBuffer | None, ipc: IpcDir | None) -> None:
    # Runs at close() or, if the user never calls it, when the writer is collected
    # or the interpreter exits: never leave a segment or a directory behind.
    if ring is not None:
        ring.unlink()
    if ipc is not None:
        ipc.remove()


class QueueWriter:
    """See the module docstring; built by `MessageQueue(...)`."""

    def __init__(self, n_reader: int, local_reader_ranks: list[int], max_chunk_bytes: int, max_chunks: int,
                 connect_ip: str | None, max_message_bytes: int | None, spin_us: float | None) -> None:
        local = set(local_reader_ranks)
        self.n_reader = n_reader
        self.local_reader_ranks = local_reader_ranks
        self.remote_reader_ranks = [r for r in range(n_reader) if r not in local]
        self.max_message_bytes = max_message_bytes
        self.ring: ShmRingBuffer | None = None
        self.ipc: IpcDir | None = None
        self.shm: ShmSender | None = None
        self.overflow: SocketSender | None = None
        self.remote: SocketSender | None = None
        self.shut = False
        self._admit: Any = None  # (rank, token) -> bool, on a sealed TCP queue
        self._ser = serde.Serializer()
        #: bytes put on each path (the shared-memory ring with its overflow socket, and TCP), for metrics
        self.bytes_shm = 0
        self.bytes_tcp = 0
        queue_id = secrets.token_bytes(16)
        local_ep = remote_ep = None
        try:
            if local_reader_ranks:
                self.ring = ShmRingBuffer.create(len(local_reader_ranks), max_chunk_bytes, max_chunks, queue_id)
                self.ipc = IpcDir()
                sock, local_ep, _ = make_publisher(self.ipc.endpoint("overflow"), sndhwm=0)
                self.overflow = SocketSender(sock, "ipc", local_reader_ranks, 0)
                self.shm = ShmSender(self.ring, local_reader_ranks, spin_us, self.ipc.path, self.overflow)
                self._put_one, self._wake = self.shm.rw.put_one, self.shm.wake_parked
            if self.remote_reader_ranks:
                sock, remote_ep, manual = make_publisher(tcp_endpoint(connect_ip or get_ip(), "*"),
                                                         sndhwm=REMOTE_SNDHWM)
                sealer = None
                if manual:  # a cluster secret: sealed messages, subscribers admitted on their token
                    secret = security.process_secret()
                    assert secret is not None
                    sealer = Sealer(queue_key(secret.derive(b"queue-aead"), queue_id), queue_id)
                    admit_key = secret.derive(b"queue-admit")
                    self._admit = lambda rank, token: hmac.compare_digest(
                        token, admission_token(admit_key, queue_id, rank))
                self.remote = SocketSender(sock, "tcp", self.remote_reader_ranks, REMOTE_SNDHWM, sealer)
        except BaseException:
            self.abort()
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self.ring, self.ipc)
        self.handle = Handle(
            version=HANDLE_VERSION, queue_id=queue_id.hex(), n_reader=n_reader,
            local_reader_ranks=local_reader_ranks,
            shm_name=self.ring.name if self.ring else None, shm_size=self.ring.size if self.ring else 0,
            max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks,
            ipc_dir=self.ipc.path if self.ipc else None, local_endpoint=local_ep, remote_endpoint=remote_ep,
            max_message_bytes=max_message_bytes, writer_pid=os.getpid())

    # -- the handshake ----------------------------------------------------------------------

    def handshake(self, deadline: float | None, timeout: float | None) -> None:
        """Wait until every reader is attached, remove the names from /dev/shm and the file system, send READY."""
        senders = [s for s in (self.overflow, self.remote) if s is not None]
        missing = {id(s.sock): set(s.readers) for s in senders}
        poller = zmq.Poller()
        for s in senders:
            poller.register(s.sock, zmq.POLLIN)
        t0 = _perf()
        next_log = t0 + 10.0
        while any(missing.values()):
            if self.shut:
                raise QueueShutdown(f"wait_until_ready interrupted by shutdown(): {self._describe(senders, missing)}")
            now = _perf()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(f"wait_until_ready timed out after {timeout}s: {self._describe(senders, missing)}")
            if now >= next_log:
                logger.info("writer waiting %.0fs for readers: %s", now - t0, self._describe(senders, missing))
                next_log = now + 10.0
            ms = 200 if deadline is None else max(1, min(200, int((deadline - now) * 1000) + 1))
            try:
                for sock, _ in poller.poll(ms):
                    admit = self._admit if self.remote is not None and sock is self.remote.sock else None
                    _read_hellos(sock, missing[id(sock)], admit)
            except zmq.ZMQError as e:
                raise translate(e, "wait_until_ready") from e
        # Every local reader has mapped the ring and opened its pipes: the names can go.
        _cleanup(self.ring, self.ipc)
        for s in senders:
            s.send_control(READY, block=True)

    def _describe(self, senders: list[SocketSender], missing: dict[int, set[int]]) -> str:
        parts = []
        for s in senders:
            late = sorted(missing[id(s.sock)])
            if late and s.path == "ipc":
                parts.append(f"local reader rank(s) {late} never attached to shared memory "
                             f"{self.ring.name if self.ring else ''}")
            elif late:
                parts.append(f"remote reader rank(s) {late} never subscribed to {self.handle.remote_endpoint}")
        return "; ".join(parts)

    # -- sending -----------------------------------------------------------------------------

    def fast_enqueue(self) -> Any:
        """The `enqueue` for this writer's paths (bound into the facade once the queue is ready)."""
        if self.max_message_bytes is not None:
            return self.enqueue
        if self.remote is None:
            return self._enqueue_shm_only
        if self.shm is None:
            return self._enqueue_remote_only
        return self.enqueue

    def _enqueue_shm_only(self, obj: Any, timeout: float | None = None, on_wait: Any = None) -> None:
        put = self._put_one
        if type(obj) is bytes:
            done = put(obj, KIND_BYTES)
            if done:
                self.bytes_shm += len(obj)
                if done == 2:
                    self._wake()
                return
        frames = self._ser.dumps(obj)
        if len(frames) == 1:
            done = put(frames[0], KIND_DATA)
            if done:
                self.bytes_shm += len(frames[0])
                if done == 2:
                    self._wake()
                return
        self.send_frames(frames, deadline_of(timeout), on_wait)

    def _enqueue_remote_only(self, obj: Any, timeout: float | None = None, on_wait: Any = None) -> None:
        if timeout is None and on_wait is None:
            if type(obj) is bytes and len(obj) <= RAW_MAX_BYTES:
                self.remote.send_raw(obj)
                self.bytes_tcp += len(obj)
                return
            frames = self._ser.dumps(obj)
            self.remote.send(frames, None, None)
            self.bytes_tcp += sum(len(f) if type(f) is bytes else f.nbytes for f in frames)
            return
        self.send_frames(self._ser.dumps(obj), deadline_of(timeout), on_wait)

    def enqueue(self, obj: Any, timeout: float | None = None, on_wait: Any = None) -> None:
        self.send_frames(self._ser.dumps(obj), deadline_of(timeout), on_wait)

    def send_frames(self, frames: list, deadline: float | None, on_wait: Any = None) -> None:
        """To every path; `on_wait` is called every few milliseconds while a full path makes it wait."""
        sizes = [len(f) if type(f) is bytes else f.nbytes for f in frames]
        if self.max_message_bytes is not None and sum(sizes) > self.max_message_bytes:
            raise MessageTooLarge(f"message is {sum(sizes)} bytes, over this queue's max_message_bytes="
                                  f"{self.max_message_bytes}; nothing was sent")
        if self.shm is not None:
            self.shm.send(frames, sizes, deadline, on_wait)
            self.bytes_shm += sum(sizes)
        if self.remote is not None:
            self.remote.send(frames, sizes, deadline, on_wait)
            self.bytes_tcp += sum(sizes)

    def status(self) -> dict[str, Any]:
        """What a look from outside may see (another thread, racy by design): bytes per path, and the ring's
        occupancy with how many chunks each local reader has not yet read or released."""
        out: dict[str, Any] = {"bytes": {"shm": self.bytes_shm, "tcp": self.bytes_tcp}}
        if self.shm is not None and self.ring is not None and not self.shut:
            rw = self.shm.rw
            behind = dict.fromkeys(self.local_reader_ranks, 0)
            occupied = 0
            try:
                for c in range(self.ring.n_chunks):
                    held = rw.holders(c)
                    occupied += bool(held)
                    for r in held:
                        behind[self.local_reader_ranks[r]] += 1
            except ValueError:  # closed meanwhile (the mapping is released): nothing to show
                return out
            out.update(chunks=self.ring.n_chunks, occupied=occupied, behind=behind)
        return out

    # -- the end -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.shut = True
        for s in (self.shm, self.overflow, self.remote):
            if s is not None:
                s.shutdown()

    @property
    def waiters(self) -> list:
        return [s.waiters for s in (self.shm, self.overflow, self.remote) if s is not None]

    def close(self, flush: bool, flush_timeout: float | None) -> None:
        """CLOSE to every reader; a remote publisher is held until its readers confirm (lingering.py)."""
        if self.shm is not None:
            self.shm.close()
        if self.overflow is not None:
            self.overflow.close()
        if self.remote is not None:
            limit = settings.get("RAYFREE_CLOSE_FLUSH_S") if flush_timeout is None else max(0.0, flush_timeout)
            if flush and limit > 0:
                lingering.hold(self.remote, self.remote_reader_ranks, HELLO_PREFIX, limit)
            else:
                self.remote.close()
        self._release()

    def abort(self) -> None:
        for s in (self.overflow, self.remote):
            if s is not None:
                s.abort()
        if self.shm is not None:
            self.shm.abort()
        self._release()

    def _release(self) -> None:
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            _cleanup(self.ring, self.ipc)
        if self.ring is not None:
            self.ring.close()


def _read_hellos(sock: zmq.Socket, missing: set[int], admit: Any = None) -> None:
    """Drop from `missing` the readers whose hello subscription arrived (XPUB reports b"\\x01" + topic).

    On a publisher that admits by hand (`admit` given), a hello with the rank's token subscribes the pipe it
    came on to every message, once per rank; any other subscription is left unanswered, so that peer gets
    nothing and its pipe never fills (it cannot hold the writer back)."""
    while True:
        try:
            msg = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        if msg[:1] != b"\x01" or not msg[1:].startswith(HELLO_PREFIX):
            continue
        body = msg[1 + len(HELLO_PREFIX):]
        rank = hello_rank(body)
        if rank is None or rank not in missing:
            continue  # unknown, or already admitted: a replayed hello gets nothing
        if admit is not None:
            if not admit(rank, body.partition(b":")[2]):
                logger.warning("refused a subscriber claiming to be reader %d without its token", rank)
                continue
            sock.setsockopt(zmq.SUBSCRIBE, b"")  # the pipe of the hello just read: every message
        missing.discard(rank)
