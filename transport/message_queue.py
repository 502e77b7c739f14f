"""`MessageQueue`: one writer, many readers; shared memory on this node, ZeroMQ to others.

The API has the shape of vLLM's `MessageQueue`, so an engine can switch by
changing an import::

    mq = MessageQueue(n_reader=4, n_local_reader=2)          # writer
    handle = mq.export_handle()                              # -> readers
    rq = MessageQueue.create_from_handle(handle, rank)       # reader
    mq.wait_until_ready(); rq.wait_until_ready()             # collective
    mq.enqueue(obj); obj = rq.dequeue()

Local readers (ranks in `local_reader_ranks`) read the shared-memory ring; a
message too large for the whole ring goes over a private ipc socket. Remote
readers subscribe to a TCP publisher bound to `connect_ip`. Every reader gets
every message, once, in order.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import weakref
from typing import Any

import zmq

from . import serde
from .errors import BadFrame, MessageTooLarge, QueueClosed, QueueShutdown, QueueTimeout, TransportError
from .handle import HANDLE_VERSION, Handle
from .net import IpcDir, get_ip, tcp_endpoint
from .shm_channel import EMPTY, WAIT_LOG_INTERVAL_S, ShmReader, ShmWriter
from .shm_ring import KIND_OVERFLOW, ShmRingBuffer
from .sockets import HELLO_PREFIX, make_publisher, make_subscriber, zmq_errors
from .waiting import SpinPolicy, spin

__all__ = ["MessageQueue", "Handle", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS"]

logger = logging.getLogger("rayfree.transport")

#: Default ring: 24 chunks of 4 MiB (96 MiB of /dev/shm). A message may span
#: several consecutive chunks, so anything up to the whole ring stays in
#: shared memory; only larger messages take the overflow socket.
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_CHUNKS = 24
#: How many messages a remote subscriber may fall behind before enqueue waits.
REMOTE_SNDHWM = 1000

_READY = b"\x00RF:READY"
_CLOSE = b"\x00RF:CLOSE"
_CTRL = b"\x00RF:"
_PARK_SLICE_MS = 500
_perf = time.perf_counter


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return _perf() + timeout


class _Receiver:
    """Blocking receive on one SUB socket that `wake()` can interrupt from another thread."""

    def __init__(self, sock: zmq.Socket, spin_us: float | None) -> None:
        self.sock = sock
        self.policy = SpinPolicy(spin_us)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.shutdown_requested = False

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _ready(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def recv(self, deadline: float | None, indefinite: bool, what: str) -> list:
        if not self._ready():
            self._wait(deadline, indefinite, what)
        sock = self.sock
        with zmq_errors(what):
            first = sock.recv(zmq.NOBLOCK)
            parts: list = [first]
            while sock.getsockopt(zmq.RCVMORE):
                parts.append(sock.recv(copy=False).buffer)
        return parts

    def _wait(self, deadline: float | None, indefinite: bool, what: str) -> None:
        pol = self.policy
        t0 = _perf()
        if spin(lambda: True if self._ready() else None, pol):
            return
        next_log = t0 + WAIT_LOG_INTERVAL_S
        while True:
            if self.shutdown_requested:
                raise QueueShutdown(f"{what} interrupted: shutdown() was called on this queue")
            now = _perf()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(f"{what} timed out after {now - t0:.3f}s")
            if now >= next_log:
                if not indefinite:
                    logger.info("%s: still waiting after %.0fs", what, now - t0)
                next_log = now + WAIT_LOG_INTERVAL_S
            ms = _PARK_SLICE_MS if deadline is None else max(0, min(_PARK_SLICE_MS, int((deadline - now) * 1000) + 1))
            events = dict(self._poller.poll(ms))
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            if self._ready():
                now = _perf()
                pol.record(now - t0, now)
                return

    def close(self) -> None:
        self.sock.close(linger=0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _cleanup(ring: ShmRingBuffer | None, ipc: IpcDir | None) -> None:
    # Runs at close() or, if the user never calls it, when the queue is collected
    # or the interpreter exits: never leave a segment or a directory behind.
    if ring is not None and ring.owner:
        ring.unlink()
    if ipc is not None:
        ipc.remove()


class MessageQueue:
    """One writer broadcasting Python objects to `n_reader` readers, in order.

    Writer side: ``MessageQueue(n_reader, n_local_reader, local_reader_ranks,
    max_chunk_bytes, max_chunks, connect_ip)``. Reader side:
    ``MessageQueue.create_from_handle(handle, rank)``.

    `max_chunk_bytes` x `max_chunks` is the ring's size in /dev/shm; a message
    occupies as many consecutive chunks as it needs. `max_message_bytes`
    (optional) refuses bigger messages with `MessageTooLarge`. `spin_us` caps
    how long a waiting call spins before it parks (see `waiting.SpinPolicy`).
    """

    def __init__(self, n_reader: int, n_local_reader: int, local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, max_chunks: int = DEFAULT_MAX_CHUNKS,
                 connect_ip: str | None = None, *, max_message_bytes: int | None = None,
                 spin_us: float | None = None) -> None:
        if not isinstance(n_reader, int) or n_reader < 1:
            raise ValueError(f"n_reader must be an int >= 1, got {n_reader!r}")
        if not isinstance(n_local_reader, int) or not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader must be an int in 0..n_reader={n_reader}, got {n_local_reader!r}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        local_reader_ranks = list(local_reader_ranks)
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError(f"local_reader_ranks {local_reader_ranks} has {len(local_reader_ranks)} entries, "
                             f"but n_local_reader={n_local_reader}")
        if len(set(local_reader_ranks)) != n_local_reader or any(
                not isinstance(r, int) or not 0 <= r < n_reader for r in local_reader_ranks):
            raise ValueError(f"local_reader_ranks {local_reader_ranks} must be distinct ints in 0..{n_reader - 1}")
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1 or None, got {max_message_bytes}")
        self._init_common(spin_us)
        self._is_writer = True
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = local_reader_ranks
        self.remote_reader_ranks = [r for r in range(n_reader) if r not in set(local_reader_ranks)]
        self.max_message_bytes = max_message_bytes
        self._ser = serde.Serializer()
        queue_id = secrets.token_bytes(16)
        try:
            if n_local_reader:
                self._ring = ShmRingBuffer.create(n_local_reader, max_chunk_bytes, max_chunks, queue_id)
                self._ipc = IpcDir()
                self._shm = ShmWriter(self._ring, local_reader_ranks, spin_us, self._ipc.path)
                self._local_pub, local_ep = make_publisher(self._ipc.endpoint("overflow"), sndhwm=0)
            else:
                local_ep = None
            if self.remote_reader_ranks:
                ip = connect_ip or get_ip()
                self._remote_pub, remote_ep = make_publisher(tcp_endpoint(ip, "*"), sndhwm=REMOTE_SNDHWM)
            else:
                remote_ep = None
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._ring, self._ipc)
        self._handle = Handle(
            version=HANDLE_VERSION, queue_id=queue_id.hex(), n_reader=n_reader,
            local_reader_ranks=local_reader_ranks,
            shm_name=self._ring.name if self._ring else None, shm_size=self._ring.size if self._ring else 0,
            max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks,
            ipc_dir=self._ipc.path if self._ipc else None, local_endpoint=local_ep, remote_endpoint=remote_ep,
            max_message_bytes=max_message_bytes, writer_pid=os.getpid())

    def _init_common(self, spin_us: float | None) -> None:
        self._ring: ShmRingBuffer | None = None
        self._shm: Any = None
        self._ipc: IpcDir | None = None
        self._local_pub: zmq.Socket | None = None
        self._remote_pub: zmq.Socket | None = None
        self._recv: _Receiver | None = None
        self._handle: Handle | None = None
        self._ready = False
        self._fast_writer: ShmWriter | None = None
        self._fast_reader: ShmReader | None = None
        self._closed = False
        self._shutdown = False
        self._spin_us = spin_us
        self._finalizer = None
        self.rank: int | None = None

    # -- reader construction -----------------------------------------------

    @classmethod
    def create_from_handle(cls, handle: Handle | bytes, rank: int, *, spin_us: float | None = None) -> MessageQueue:
        """Attach reader `rank`: through shared memory if it is a local reader, else over TCP."""
        if not isinstance(handle, Handle):
            handle = Handle.from_bytes(handle)
        else:
            handle.validate()
        if not isinstance(rank, int) or not 0 <= rank < handle.n_reader:
            raise ValueError(f"rank {rank!r} is not a reader of this queue: its readers are ranks "
                             f"0..{handle.n_reader - 1}")
        self = cls.__new__(cls)
        self._init_common(spin_us)
        self._is_writer = False
        self._handle = handle
        self.rank = rank
        self.n_reader = handle.n_reader
        self.n_local_reader = handle.n_local_reader
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.remote_reader_ranks = [r for r in range(handle.n_reader) if r not in set(handle.local_reader_ranks)]
        self.max_message_bytes = handle.max_message_bytes
        limit = None if handle.max_message_bytes is None else handle.max_message_bytes + 65536
        try:
            if rank in handle.local_reader_ranks:
                self._ring = ShmRingBuffer.attach(handle.shm_name, handle.shm_size, handle.queue_id)
                self._shm = ShmReader(self._ring, handle.local_reader_ranks.index(rank), spin_us, handle.ipc_dir)
                sock = make_subscriber(handle.local_endpoint, str(rank).encode(), maxmsgsize=limit)
            else:
                sock = make_subscriber(handle.remote_endpoint, str(rank).encode(), maxmsgsize=limit)
            self._recv = _Receiver(sock, spin_us)
        except BaseException:
            self.close()
            raise
        return self

    # -- public API ----------------------------------------------------------

    def export_handle(self) -> Handle:
        if not self._is_writer:
            raise RuntimeError("only the writer exports a handle; readers were made from it")
        assert self._handle is not None
        return self._handle

    @property
    def handle(self) -> Handle:
        assert self._handle is not None
        return self._handle

    @property
    def is_writer(self) -> bool:
        return self._is_writer

    @property
    def is_local_reader(self) -> bool:
        return not self._is_writer and self._ring is not None

    @property
    def is_remote_reader(self) -> bool:
        return not self._is_writer and self._ring is None

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """The collective handshake: the writer waits until every reader is attached.

        The writer then unlinks the shared-memory segment and the ipc socket
        file (nothing is left on disk even if a process is SIGKILLed later) and
        sends READY; each reader waits for READY.
        """
        self._check_open()
        if self._ready:
            return
        deadline = _deadline(timeout)
        if self._is_writer:
            self._writer_handshake(deadline, timeout)
        else:
            assert self._recv is not None
            what = f"reader rank {self.rank} waiting for the writer's READY"
            try:
                parts = self._recv.recv(deadline, True, what)
            except QueueTimeout:
                raise QueueTimeout(f"{what}: nothing within {timeout}s; is the writer calling "
                                   f"wait_until_ready()?") from None
            if parts != [_READY]:
                raise BadFrame(f"{what}: expected READY, got {len(parts)} frame(s) starting {parts[0][:16]!r}")
        self._ready = True
        # The hot paths skip the role and state checks: they are set only on a
        # ready queue of the matching role and cleared by shutdown().
        if self._is_writer and self._remote_pub is None and self.max_message_bytes is None:
            self._fast_writer = self._shm
        if isinstance(self._shm, ShmReader):
            self._fast_reader = self._shm

    def _writer_handshake(self, deadline: float | None, timeout: float | None) -> None:
        missing_local = set(self.local_reader_ranks)
        missing_remote = set(self.remote_reader_ranks)
        poller = zmq.Poller()
        socks = [s for s in (self._local_pub, self._remote_pub) if s is not None]
        for s in socks:
            poller.register(s, zmq.POLLIN)
        t0 = _perf()
        next_log = t0 + 10.0
        while missing_local or missing_remote:
            now = _perf()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(
                    f"wait_until_ready timed out after {timeout}s: {self._describe_missing(missing_local, missing_remote)}")
            if now >= next_log:
                logger.info("writer waiting %.0fs for readers: %s", now - t0,
                            self._describe_missing(missing_local, missing_remote))
                next_log = now + 10.0
            ms = 200 if deadline is None else max(1, min(200, int((deadline - now) * 1000) + 1))
            for sock, _ in poller.poll(ms):
                while True:
                    try:
                        msg = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg[:1] != b"\x01" or not msg[1:].startswith(HELLO_PREFIX):
                        continue
                    try:
                        r = int(msg[1 + len(HELLO_PREFIX):])
                    except ValueError:
                        continue
                    (missing_local if sock is self._local_pub else missing_remote).discard(r)
        # Every local reader has mapped the ring and connected: the names can go.
        if self._ring is not None:
            self._ring.unlink()
        if self._ipc is not None:
            self._ipc.remove()
        for s in socks:
            with zmq_errors("sending READY"):
                s.send(_READY)

    def _describe_missing(self, local: set[int], remote: set[int]) -> str:
        parts = []
        if local:
            parts.append(f"local reader rank(s) {sorted(local)} never attached to shared memory "
                         f"{self._ring.name if self._ring else ''}")
        if remote:
            ep = self._handle.remote_endpoint if self._handle else "?"
            parts.append(f"remote reader rank(s) {sorted(remote)} never subscribed to {ep}")
        return "; ".join(parts)

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj` to every reader. Blocks while the ring is full, up to `timeout` seconds."""
        fast = self._fast_writer
        if fast is not None:
            frames = self._ser.dumps(obj)
            if len(frames) == 1 and fast.put_one(frames[0]):
                return
        else:
            if not self._is_writer:
                raise RuntimeError(f"reader rank {self.rank} cannot enqueue: only the queue's writer sends")
            self._check_usable()
            frames = self._ser.dumps(obj)
        sizes = [len(f) if type(f) is bytes else f.nbytes for f in frames]
        total = sum(sizes)
        if self.max_message_bytes is not None and total > self.max_message_bytes:
            raise MessageTooLarge(f"message is {total} bytes, over this queue's max_message_bytes="
                                  f"{self.max_message_bytes}; nothing was sent")
        deadline = None if timeout is None else _deadline(timeout)
        shm = self._shm
        if shm is not None:
            nbytes = shm.slot_bytes(sizes)
            if nbytes <= shm.ring.capacity:
                if len(frames) > 1 or not shm.put_one(frames[0]):
                    shm.write(frames, sizes, nbytes, deadline)
            else:
                sock = self._local_pub
                shm.write_overflow(lambda: self._send(sock, frames, deadline, "local overflow"), deadline)
        if self._remote_pub is not None:
            self._send(self._remote_pub, frames, deadline, "remote")

    def _send(self, sock: zmq.Socket, frames: list, deadline: float | None, path: str) -> None:
        ms = -1 if deadline is None else max(0, int((deadline - _perf()) * 1000))
        sock.setsockopt(zmq.SNDTIMEO, ms)
        try:
            sock.send_multipart(frames, copy=True)
        except zmq.Again:
            who = self.remote_reader_ranks if path == "remote" else self.local_reader_ranks
            raise QueueTimeout(f"enqueue timed out sending to {path} reader rank(s) {who}: they are "
                               f"{REMOTE_SNDHWM if path == 'remote' else 'many'} messages behind or unreachable") from None
        except zmq.ZMQError as e:
            raise TransportError(f"enqueue to {path} readers failed: {e.strerror}") from e

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message. Waits up to `timeout` seconds (None: forever, logging
        every minute unless `indefinite`)."""
        shm = self._fast_reader
        if shm is not None:
            obj = shm.get_one()
            if obj is not EMPTY:
                return obj
            if timeout is not None and timeout < 0:
                raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
            shm.wait_readable(timeout, indefinite)
            obj = shm.get_one()
            if obj is not EMPTY:
                return obj
        else:
            if self._is_writer:
                raise RuntimeError("the writer cannot dequeue: readers are made with create_from_handle()")
            self._check_usable()
            shm = self._shm
        deadline = _deadline(timeout)
        if shm is not None:
            start, kind, span = shm.next_slot(timeout, indefinite)
            if kind != KIND_OVERFLOW:
                return shm.read(start, span)
            shm.release(start, span)
            return self._recv_obj(deadline, indefinite, "dequeue (overflow)")
        return self._recv_obj(deadline, indefinite, "dequeue")

    def _recv_obj(self, deadline: float | None, indefinite: bool, what: str) -> Any:
        assert self._recv is not None
        parts = self._recv.recv(deadline, indefinite, what)
        first = parts[0]
        if first[:4] == _CTRL:
            if first == _CLOSE:
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            raise BadFrame(f"unexpected control message {first!r}")
        try:
            return serde.loads(first, parts[1:])
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad frame
            raise BadFrame(f"could not decode a {len(parts)}-frame message: {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        """Make blocked and future enqueue/dequeue calls raise QueueShutdown (any thread)."""
        self._shutdown = True
        self._fast_writer = self._fast_reader = None
        if self._shm is not None:
            self._shm.shutdown_requested = True
            if not self._is_writer and not self._closed:
                self._shm.wake()
        if self._recv is not None:
            self._recv.shutdown_requested = True
            self._recv.wake()

    def close(self) -> None:
        """Release every socket and mapping; the writer also tells readers it is gone."""
        if self._closed:
            return
        self.shutdown()
        self._closed = True
        if self._is_writer:
            if isinstance(self._shm, ShmWriter):
                self._shm.close()
            for s in (self._local_pub, self._remote_pub):
                if s is not None:
                    try:
                        s.send(_CLOSE, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                    s.close(linger=100)
        if isinstance(self._shm, ShmReader):
            self._shm.close()
        if self._recv is not None:
            self._recv.close()
        if self._finalizer is not None:
            self._finalizer()
        else:
            _cleanup(self._ring, self._ipc)
        if self._ring is not None:
            self._ring.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this queue is closed")

    def _check_usable(self) -> None:
        if self._shutdown:
            self._check_open()
            raise QueueShutdown("this queue was shut down")
        if not self._ready:
            raise RuntimeError("call wait_until_ready() on the writer and every reader before "
                               "enqueue/dequeue")

    def __repr__(self) -> str:
        role = "writer" if self._is_writer else ("local" if self._ring else "remote") + f" reader {self.rank}"
        return (f"<MessageQueue {role} readers={self.n_reader} local={self.local_reader_ranks} "
                f"{'closed' if self._closed else 'open'}>")


# Used by tests and the bench to know that no in-place payload is alive.
def live_leases(mq: MessageQueue) -> int:
    return mq._shm.leases if isinstance(mq._shm, ShmReader) else 0

