"""`MessageQueue`: one writer, many readers; shared memory on this node, ZeroMQ to others.

The API has the shape of vLLM's `MessageQueue`, so an engine can switch by
changing an import::

    mq = MessageQueue(n_reader=4, n_local_reader=2)          # writer
    handle = mq.export_handle()                              # -> readers
    rq = MessageQueue.create_from_handle(handle, rank)       # reader
    mq.wait_until_ready(); rq.wait_until_ready()             # collective
    mq.enqueue(obj); obj = rq.dequeue()

The facade holds a `QueueWriter` (writer.py) or a `QueueReader` (reader.py)
and checks one flag per call (ready and not shut down); the hot path itself
is each channel's `try_send`/`try_recv`, written once. Every reader gets
every message, once, in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from ..channel import Sender
from ..errors import QueueShutdown, TransportError
from ..secure import signing
from ..shm.segment import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
from .handle import Handle
from .reader import QueueReader
from .writer import QueueWriter, deadline_of

__all__ = ["MessageQueue", "Handle", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS"]

logger = logging.getLogger("rayfree.transport")

#: close() waits this long for threads blocked in the queue to leave.
CLOSE_WAIT_S = 2.0


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

    _w: QueueWriter | None
    _r: QueueReader | None
    _handle: Handle | None
    _one: Sender | None
    _dumps: Callable[[Any], list[Any]]
    _send_frames: Callable[[list[Any], float | None, Callable[[], None] | None, Sender | None], None]
    _recv: Callable[[float | None, bool], Any]

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        *,
        max_message_bytes: int | None = None,
        spin_us: float | None = None,
        remote_subscribers: list[int] | None = None,
    ) -> None:
        """The writer's side (readers attach with `create_from_handle`).

        Args:
            n_reader: how many readers every message goes to.
            n_local_reader: how many of them read the shared-memory ring (same node); the rest read over TCP.
            local_reader_ranks: the reader ranks that are local (default: 0..n_local_reader-1).
            max_chunk_bytes: the size of one ring chunk; a message takes as many consecutive chunks as it needs.
            max_chunks: chunks in the ring (its size in /dev/shm is max_chunk_bytes x max_chunks).
            connect_ip: the address remote readers connect to (this node's on the cluster network).
            max_message_bytes: refuse bigger messages with `MessageTooLarge` (None: no limit).
            spin_us: how long a waiting call may spin before it parks, in microseconds (None: RAYFREE_SPIN_US).
            remote_subscribers: the remote readers that subscribe to this writer themselves (None: every remote
                reader). A node's relay (transport/relay) subscribes once, under its first rank, for the
                ranks of its node, which read its ring.
        """
        if not isinstance(n_reader, int) or n_reader < 1:
            raise ValueError(f"n_reader must be an int >= 1, got {n_reader!r}")
        if not isinstance(n_local_reader, int) or not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader must be an int in 0..n_reader={n_reader}, got {n_local_reader!r}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        local_reader_ranks = list(local_reader_ranks)
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"local_reader_ranks {local_reader_ranks} has {len(local_reader_ranks)} entries, "
                f"but n_local_reader={n_local_reader}"
            )
        if len(set(local_reader_ranks)) != n_local_reader or any(
            not isinstance(r, int) or not 0 <= r < n_reader for r in local_reader_ranks
        ):
            raise ValueError(f"local_reader_ranks {local_reader_ranks} must be distinct ints in 0..{n_reader - 1}")
        if remote_subscribers is not None and (
            not remote_subscribers or any(r in local_reader_ranks or not 0 <= r < n_reader for r in remote_subscribers)
        ):
            raise ValueError(
                f"remote_subscribers {remote_subscribers} must be remote reader ranks (not in {local_reader_ranks}, "
                f"in 0..{n_reader - 1})"
            )
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1 or None, got {max_message_bytes}")
        self._init_common(n_reader, local_reader_ranks, max_message_bytes)
        self._w = w = QueueWriter(
            n_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            max_message_bytes,
            spin_us,
            remote_subscribers,
        )
        self._handle = w.handle

    def _init_common(self, n_reader: int, local_reader_ranks: list[int], max_message_bytes: int | None) -> None:
        self.n_reader = n_reader
        self.n_local_reader = len(local_reader_ranks)
        self.local_reader_ranks = local_reader_ranks
        local = set(local_reader_ranks)
        self.remote_reader_ranks = [r for r in range(n_reader) if r not in local]
        self.max_message_bytes = max_message_bytes
        self.rank: int | None = None
        self._w = None
        self._r = None
        self._handle = None
        self._ready = False
        self._closed = False
        self._shutdown = False
        #: ready and not shut down: the one check enqueue/dequeue make
        self._usable = False

    @classmethod
    def create_from_handle(
        cls,
        handle: Handle | bytes,
        rank: int,
        *,
        spin_us: float | None = None,
        zero_copy: bool = False,
        _nonce: bytes | None = None,
    ) -> MessageQueue:
        """Attach reader `rank`: through shared memory if it is a local reader, else over TCP.

        Every tensor or array a reader receives is its own writable copy. `zero_copy=True` (local
        readers) hands big payloads over as read-only-by-contract views of the shared ring instead:
        faster, but every local reader sees the same bytes, and a view kept alive keeps its chunks
        from the writer (it waits, then times out naming this reader). Signed handle bytes are
        verified first; the same signed handle cannot attach the same reader twice in one process.
        """
        if not isinstance(handle, Handle):
            handle, _nonce = Handle.from_signed(handle)
        else:
            handle.validate()
        signing.check_fresh(_nonce, f"reader {rank} of queue {handle.queue_id}")
        if not isinstance(rank, int) or not 0 <= rank < handle.n_reader:
            raise ValueError(
                f"rank {rank!r} is not a reader of this queue: its readers are ranks 0..{handle.n_reader - 1}"
            )
        self = cls.__new__(cls)
        self._init_common(handle.n_reader, list(handle.local_reader_ranks), handle.max_message_bytes)
        self._handle = handle
        self.rank = rank
        self._r = QueueReader(handle, rank, spin_us, zero_copy)
        return self

    # -- what the queue is ---------------------------------------------------------------------

    def export_handle(self) -> Handle:
        if self._w is None:
            raise RuntimeError("only the writer exports a handle; readers were made from it")
        assert self._handle is not None
        return self._handle

    @property
    def handle(self) -> Handle:
        assert self._handle is not None
        return self._handle

    def status(self) -> dict[str, Any]:
        """The writer's view for status and metrics: bytes per path; ring chunks, how many are occupied and
        how many each local reader has not read yet (`behind`). Empty on a reader or a closed queue."""
        w = self._w
        return w.status() if w is not None and not self._closed else {}

    @property
    def is_writer(self) -> bool:
        return self._w is not None

    @property
    def is_local_reader(self) -> bool:
        return self._r is not None and self._r.is_local

    # -- the handshake ---------------------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """The collective handshake: the writer waits until every reader is attached.

        The writer then unlinks the shared-memory segment and the ipc
        directory (nothing is left behind even if a process is SIGKILLed
        later) and sends READY; each reader waits for READY.
        """
        self._check_open()
        if self._ready:
            return
        deadline = deadline_of(timeout)
        if self._w is not None:
            self._w.handshake(deadline, timeout)
        else:
            assert self._r is not None
            self._r.handshake(deadline, timeout)
        self._ready = True
        # The role's own call, looked up once for the hot path (the methods of this facade stay what they are):
        # a writer's `_one` is `QueueWriter.one_path` (its only Sender, whose `try_send` takes a small message),
        # `_dumps` `QueueWriter.dumps` and `_send_frames` `QueueWriter.send_frames`; a reader's `_recv` is its
        # receiver's `recv` (`ShmReceiver.recv` or `SocketReceiver.recv`).
        self._one = None
        if self._w is not None:
            self._recv = self._not_a_reader
            self._one, self._dumps, self._send_frames = self._w.one_path, self._w.dumps, self._w.send_frames
        elif self._r is not None:
            self._dumps, self._recv = self._not_the_writer, self._r.receiver.recv
        self._usable = not self._shutdown

    def _not_the_writer(self, *_: Any) -> list[Any]:
        raise RuntimeError(f"reader rank {self.rank} cannot enqueue: only the queue's writer sends")

    def _not_a_reader(self, *_: Any) -> Any:
        raise RuntimeError("the writer cannot dequeue: readers are made with create_from_handle()")

    def broadcast_object(self, obj: Any = None) -> Any:
        """vLLM's symmetric call: the writer sends `obj` and returns it, a reader returns what it receives."""
        if self._w is not None:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    @property
    def shutting_down(self) -> bool:
        """`shutdown()` was called (vLLM's name)."""
        return self._shutdown

    # -- messages ----------------------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None, on_wait: Callable[[], None] | None = None) -> None:
        """Send `obj` to every reader. Blocks while readers lag, up to `timeout` seconds (a negative one counts as
        0), calling `on_wait()` every few milliseconds meanwhile (the executor reads replies there)."""
        if self._usable:
            frames = self._dumps(obj)
            one = self._one
            if one is not None and one.try_send(frames):  # a queue with one path (most), taking it now
                return
            self._send_frames(frames, timeout, on_wait, one)  # every path, waiting where one lags
            return
        if self._w is None:
            raise RuntimeError(f"reader rank {self.rank} cannot enqueue: only the queue's writer sends")
        self._check_usable()  # raises: not ready yet, or shut down

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message. Waits up to `timeout` seconds (None: forever, logging
        every minute unless `indefinite`)."""
        if self._usable:
            return self._recv(timeout, indefinite)
        if self._r is None:
            raise RuntimeError("the writer cannot dequeue: readers are made with create_from_handle()")
        self._check_usable()  # raises: not ready yet, or shut down

    # -- the end -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Make blocked and future enqueue/dequeue calls raise QueueShutdown (any thread)."""
        self._shutdown = True
        self._usable = False
        if self._w is not None:
            self._w.shutdown()
        if self._r is not None and not self._closed:
            self._r.shutdown()

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
        flush = self._w is not None and self._ready and not self._shutdown
        self.shutdown()
        self._closed = True
        if self._w is not None:
            waiters = self._w.waiters
        else:
            waiters = self._r.waiters if self._r is not None else []
        for w in waiters:
            if not w.wait_idle(CLOSE_WAIT_S):
                logger.warning("closing %r while a thread is still blocked in it", self)
        if self._w is not None:
            self._w.close(flush, flush_timeout)
        if self._r is not None:
            self._r.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this queue is closed")

    def _check_usable(self) -> NoReturn:
        """Why this queue cannot be used now (enqueue and dequeue call it only when it cannot)."""
        if self._shutdown:
            self._check_open()
            raise QueueShutdown("this queue was shut down")
        raise RuntimeError("call wait_until_ready() on the writer and every reader before enqueue/dequeue")

    def __repr__(self) -> str:
        role = (
            "writer"
            if self._w is not None
            else ("local" if self.is_local_reader else "remote") + f" reader {self.rank}"
        )
        return (
            f"<MessageQueue {role} readers={self.n_reader} local={self.local_reader_ranks} "
            f"{'closed' if self._closed else 'open'}>"
        )
