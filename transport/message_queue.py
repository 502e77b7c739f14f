"""`MessageQueue`: one writer, many readers; shared memory on this node, ZeroMQ to others.

The API has the shape of vLLM's `MessageQueue`, so an engine can switch by
changing an import::

    mq = MessageQueue(n_reader=4, n_local_reader=2)          # writer
    handle = mq.export_handle()                              # -> readers
    rq = MessageQueue.create_from_handle(handle, rank)       # reader
    mq.wait_until_ready(); rq.wait_until_ready()             # collective
    mq.enqueue(obj); obj = rq.dequeue()

Local readers (ranks in `local_reader_ranks`) read the shared-memory ring
(shm_channel.py); a message too large for the whole ring goes over a private
ipc socket. Remote readers subscribe to a TCP publisher bound to
`connect_ip` (zmq_channel.py). Every reader gets every message, once, in order.
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
from . import lingering, security
from .errors import BadFrame, MessageTooLarge, QueueShutdown, QueueTimeout, TransportError
from .handle import HANDLE_VERSION, Handle
from .net import IpcDir, get_ip, tcp_endpoint
from .shm_channel import EMPTY, ShmReader, ShmWriter
from .shm_ring import KIND_BYTES, KIND_OVERFLOW, ShmRingBuffer
from .sockets import HELLO_PREFIX, make_publisher, make_subscriber
from .zmq_channel import CLOSE, RAW_MAX_BYTES, READY, SocketReceiver, SocketSender

__all__ = ["MessageQueue", "Handle", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS"]

logger = logging.getLogger("rayfree.transport")

#: Default ring: 24 chunks of 4 MiB (96 MiB of /dev/shm). A message may span
#: several consecutive chunks, so anything up to the whole ring stays in
#: shared memory; only larger messages take the overflow socket.
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_CHUNKS = 24
#: How many messages a remote subscriber may fall behind before enqueue waits.
REMOTE_SNDHWM = 1000
#: close() waits this long for threads blocked in the queue to leave.
CLOSE_WAIT_S = 2.0
#: A closed writer keeps its remote publisher up to this long for readers to confirm CLOSE (RAYFREE_CLOSE_FLUSH_S).
CLOSE_FLUSH_S = float(os.environ.get("RAYFREE_CLOSE_FLUSH_S", "5"))

_perf = time.perf_counter


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return _perf() + timeout


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
        self._init_common(True, n_reader, local_reader_ranks, max_message_bytes)
        self._ser = serde.Serializer()
        queue_id = secrets.token_bytes(16)
        local_ep = remote_ep = None
        try:
            if n_local_reader:
                self._ring = ShmRingBuffer.create(n_local_reader, max_chunk_bytes, max_chunks, queue_id)
                self._ipc = IpcDir()
                self._shm = ShmWriter(self._ring, local_reader_ranks, spin_us, self._ipc.path)
                sock, local_ep = make_publisher(self._ipc.endpoint("overflow"), sndhwm=0)
                self._local_out = SocketSender(sock, "local overflow", local_reader_ranks, 0)
            if self.remote_reader_ranks:
                sock, remote_ep = make_publisher(tcp_endpoint(connect_ip or get_ip(), "*"), sndhwm=REMOTE_SNDHWM)
                self._remote_out = SocketSender(sock, "remote", self.remote_reader_ranks, REMOTE_SNDHWM)
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

    def _init_common(self, is_writer: bool, n_reader: int, local_reader_ranks: list[int],
                     max_message_bytes: int | None) -> None:
        self._is_writer = is_writer
        self.n_reader = n_reader
        self.n_local_reader = len(local_reader_ranks)
        self.local_reader_ranks = local_reader_ranks
        local = set(local_reader_ranks)
        self.remote_reader_ranks = [r for r in range(n_reader) if r not in local]
        self.max_message_bytes = max_message_bytes
        self.rank: int | None = None
        self._ring: ShmRingBuffer | None = None
        self._shm: ShmWriter | ShmReader | None = None
        self._ipc: IpcDir | None = None
        self._local_out: SocketSender | None = None
        self._remote_out: SocketSender | None = None
        self._recv: SocketReceiver | None = None
        self._handle: Handle | None = None
        self._finalizer: weakref.finalize | None = None
        self._ready = False
        self._closed = False
        self._shutdown = False
        # Hot paths, set by wait_until_ready() for the queue's role, cleared by shutdown().
        self._fast_shm_writer: ShmWriter | None = None
        self._fast_sock_writer: SocketSender | None = None
        self._fast_shm_reader: ShmReader | None = None
        self._fast_sock_reader: SocketReceiver | None = None

    # -- reader construction -----------------------------------------------

    @classmethod
    def create_from_handle(cls, handle: Handle | bytes, rank: int, *, spin_us: float | None = None,
                           _nonce: bytes | None = None) -> MessageQueue:
        """Attach reader `rank`: through shared memory if it is a local reader, else over TCP.

        Signed handle bytes are verified first; the same signed handle cannot attach the same
        reader twice in one process (a replay).
        """
        if not isinstance(handle, Handle):
            handle, _nonce = Handle.from_signed(handle)
        else:
            handle.validate()
        security.check_fresh(_nonce, f"reader {rank} of queue {handle.queue_id}")
        if not isinstance(rank, int) or not 0 <= rank < handle.n_reader:
            raise ValueError(f"rank {rank!r} is not a reader of this queue: its readers are ranks "
                             f"0..{handle.n_reader - 1}")
        self = cls.__new__(cls)
        self._init_common(False, handle.n_reader, list(handle.local_reader_ranks), handle.max_message_bytes)
        self._handle = handle
        self.rank = rank
        limit = None if handle.max_message_bytes is None else handle.max_message_bytes + 65536
        try:
            if rank in handle.local_reader_ranks:
                self._ring = ShmRingBuffer.attach(handle.shm_name, handle.shm_size, handle.queue_id)
                self._shm = ShmReader(self._ring, handle.local_reader_ranks.index(rank), spin_us, handle.ipc_dir)
                sock = make_subscriber(handle.local_endpoint, str(rank).encode(), maxmsgsize=limit)
            else:
                sock = make_subscriber(handle.remote_endpoint, str(rank).encode(), maxmsgsize=limit)
            self._recv = SocketReceiver(sock, None if self._ring is not None else HELLO_PREFIX + str(rank).encode())
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

        The writer then unlinks the shared-memory segment and the ipc
        directory (nothing is left behind even if a process is SIGKILLed
        later) and sends READY; each reader waits for READY.
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
            if len(parts) != 1 or parts[0] != READY:
                raise BadFrame(f"{what}: expected READY, got {len(parts)} frame(s) "
                               f"starting {bytes(parts[0][:16])!r}")
        self._ready = True
        if self._is_writer:
            if self._remote_out is None and self.max_message_bytes is None:
                self._fast_shm_writer = self._shm
            if self._shm is None and self.max_message_bytes is None:
                self._fast_sock_writer = self._remote_out
        elif self._shm is not None:
            self._fast_shm_reader = self._shm
        else:
            self._fast_sock_reader = self._recv

    def _writer_handshake(self, deadline: float | None, timeout: float | None) -> None:
        missing = {"local": set(self.local_reader_ranks), "remote": set(self.remote_reader_ranks)}
        senders = {"local": self._local_out, "remote": self._remote_out}
        poller = zmq.Poller()
        for s in senders.values():
            if s is not None:
                poller.register(s.sock, zmq.POLLIN)
        t0 = _perf()
        next_log = t0 + 10.0
        while missing["local"] or missing["remote"]:
            if self._shutdown:
                raise QueueShutdown(f"wait_until_ready interrupted by shutdown(): {self._describe_missing(missing)}")
            now = _perf()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(f"wait_until_ready timed out after {timeout}s: {self._describe_missing(missing)}")
            if now >= next_log:
                logger.info("writer waiting %.0fs for readers: %s", now - t0, self._describe_missing(missing))
                next_log = now + 10.0
            ms = 200 if deadline is None else max(1, min(200, int((deadline - now) * 1000) + 1))
            for sock, _ in poller.poll(ms):
                which = "local" if self._local_out is not None and sock is self._local_out.sock else "remote"
                while True:
                    try:
                        msg = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    # XPUB reports b"\x01" + topic per subscription; readers add a hello topic.
                    if msg[:1] == b"\x01" and msg[1:].startswith(HELLO_PREFIX):
                        try:
                            missing[which].discard(int(msg[1 + len(HELLO_PREFIX):]))
                        except ValueError:
                            pass
        # Every local reader has mapped the ring and opened its pipes: the names can go.
        if self._ring is not None:
            self._ring.unlink()
        if self._ipc is not None:
            self._ipc.remove()
        for s in senders.values():
            if s is not None:
                s.send_control(READY, block=True)

    def _describe_missing(self, missing: dict[str, set[int]]) -> str:
        parts = []
        if missing["local"]:
            parts.append(f"local reader rank(s) {sorted(missing['local'])} never attached to shared memory "
                         f"{self._ring.name if self._ring else ''}")
        if missing["remote"]:
            parts.append(f"remote reader rank(s) {sorted(missing['remote'])} never subscribed to "
                         f"{self.handle.remote_endpoint}")
        return "; ".join(parts)

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj` to every reader. Blocks while readers lag, up to `timeout` seconds."""
        shm = self._fast_shm_writer
        if shm is not None:
            if type(obj) is bytes and shm.put_one(obj, KIND_BYTES):
                return
            frames = self._ser.dumps(obj)
            if len(frames) == 1 and shm.put_one(frames[0]):
                return
        elif self._fast_sock_writer is not None and timeout is None:
            if type(obj) is bytes and len(obj) <= RAW_MAX_BYTES:
                self._fast_sock_writer.send_raw(obj)
                return
            frames = self._ser.dumps(obj)
            self._fast_sock_writer.send(frames, None)
            return
        else:
            if not self._is_writer:
                raise RuntimeError(f"reader rank {self.rank} cannot enqueue: only the queue's writer sends")
            self._check_usable()
            frames = self._ser.dumps(obj)
        self._enqueue_frames(frames, _deadline(timeout))

    def _enqueue_frames(self, frames: list, deadline: float | None) -> None:
        sizes = [len(f) if type(f) is bytes else f.nbytes for f in frames]
        if self.max_message_bytes is not None and sum(sizes) > self.max_message_bytes:
            raise MessageTooLarge(f"message is {sum(sizes)} bytes, over this queue's max_message_bytes="
                                  f"{self.max_message_bytes}; nothing was sent")
        shm = self._shm
        if isinstance(shm, ShmWriter):
            nbytes = shm.slot_bytes(sizes)
            if nbytes <= shm.ring.capacity:
                if len(frames) > 1 or not shm.put_one(frames[0]):
                    shm.write(frames, sizes, nbytes, deadline)
            else:
                out = self._local_out
                assert out is not None
                shm.write_overflow(lambda: out.send(frames, deadline), deadline)
        if self._remote_out is not None:
            self._remote_out.send(frames, deadline)

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message. Waits up to `timeout` seconds (None: forever, logging
        every minute unless `indefinite`)."""
        shm = self._fast_shm_reader
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
        elif self._fast_sock_reader is not None:
            if timeout is not None and timeout < 0:
                raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
            return self._fast_sock_reader.get(timeout, indefinite)
        else:
            if self._is_writer:
                raise RuntimeError("the writer cannot dequeue: readers are made with create_from_handle()")
            self._check_usable()
        deadline = _deadline(timeout)
        recv = self._recv
        assert recv is not None
        if isinstance(self._shm, ShmReader):
            start, kind, span = self._shm.next_slot(timeout, indefinite)
            if kind != KIND_OVERFLOW:
                return self._shm.read(start, span)
            self._shm.release(start, span)
            return recv.decode(recv.recv(deadline, indefinite, "dequeue (overflow)"))
        return recv.get(timeout, indefinite)

    def shutdown(self) -> None:
        """Make blocked and future enqueue/dequeue calls raise QueueShutdown (any thread)."""
        self._shutdown = True
        self._fast_shm_writer = self._fast_sock_writer = None
        self._fast_shm_reader = self._fast_sock_reader = None
        if self._shm is not None:
            self._shm.shutdown_requested = True
            if isinstance(self._shm, ShmReader) and not self._closed:
                self._shm.wake()
        if self._recv is not None:
            self._recv.shutdown_requested = True

    def close(self, *, flush_timeout: float | None = None) -> None:
        """Release every socket and mapping; the writer also tells readers it is gone.

        A writer's remote publisher is kept open after close() until each
        remote reader has read everything up to CLOSE or disconnected, for at
        most `flush_timeout` seconds (default RAYFREE_CLOSE_FLUSH_S=5), and
        the process waits for it at exit, so nothing in flight is lost
        (lingering.py); close() itself does not wait. 0 closes at once, and so
        does a queue that was shut down. Call it from the thread that uses the
        queue, or after `shutdown()` from any thread: threads blocked in this
        queue are woken and let out first.
        """
        if self._closed:
            return
        flush = (self._is_writer and self._ready and not self._shutdown and self._remote_out is not None)
        self.shutdown()
        self._closed = True
        for ch in (self._shm, self._recv):
            if ch is not None and not ch.waiters.wait_idle(CLOSE_WAIT_S):
                logger.warning("closing %r while a thread is still blocked in it", self)
        if isinstance(self._shm, ShmWriter):
            self._shm.close()
        elif isinstance(self._shm, ShmReader):
            self._shm.close()
        if self._local_out is not None:
            self._local_out.send_control(CLOSE, block=False)
            self._local_out.close(linger_ms=100)
        if self._remote_out is not None:
            limit = CLOSE_FLUSH_S if flush_timeout is None else max(0.0, flush_timeout)
            if flush and limit > 0:
                lingering.hold(self._remote_out, self.remote_reader_ranks, HELLO_PREFIX, limit)
            else:
                self._remote_out.send_control(CLOSE, block=False)
                self._remote_out.close(linger_ms=100)
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
