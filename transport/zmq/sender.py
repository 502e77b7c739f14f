"""The publisher's end of the socket channel: frames over ZeroMQ pub/sub.

Remote readers subscribe over TCP; a ring's overflow travels over ipc.

A message is one multipart ZeroMQ message: frame 0 the pickle stream, the
rest out-of-band buffers (see serde.py). A single frame that starts with
`CTRL` is a control message (READY, CLOSE); one that starts with serde's `RAW`
is a small bytes message sent without pickle. A pickle stream starts with
neither. Every message of a stream carries its sequence number (a sealed
one in its sealed header, an insecure one as 8 bytes before frame 0), so a
reader knows a lost, repeated or reordered message for what it is. Every
raw socket call sits inside one `zmq_errors` block (sockets.py).

Both ends keep the Python work around each send and receive small: on a
machine with few cores, every microsecond spent there is a microsecond that
ZeroMQ's own I/O thread waits for a core.
"""

from __future__ import annotations

import hmac
import logging
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from .. import serde
from ..channel import Sender, frame_sizes
from ..errors import QueueShutdown, QueueTimeout, TransportError
from ..secure import policy
from ..secure.aead import SEG_MIN, Sealer, admission_token, queue_key
from .sockets import HELLO_PREFIX, make_publisher, tracker_done, zmq_errors

__all__ = ["SocketSender", "CTRL", "READY", "CLOSE", "SLICE_MS", "SEQ", "hello_rank"]

logger = logging.getLogger("rayfree.transport")

CTRL = b"\x00RF:"
READY = CTRL + b"READY"
CLOSE = CTRL + b"CLOSE"
RAW = serde.RAW
#: A blocked call re-checks for shutdown this often.
SLICE_MS = 100
#: Frames at least this big go to ZeroMQ without a copy.
ZERO_COPY_MIN = 64 << 10

_perf = time.perf_counter
#: An insecure stream's sequence number, in front of each message's first frame (a sealed one's is in its header)
SEQ = struct.Struct("<Q")
_seq_pack = SEQ.pack
#: What a send raises only before ZeroMQ took the message: then its sequence number is taken back. Anything else
#: (a KeyboardInterrupt just after ZeroMQ took it) keeps the number spent: a gap the readers report beats a GCM
#: nonce used twice.
_NOT_SENT = (QueueTimeout, QueueShutdown)


def hello_rank(body: bytes) -> int | None:
    """The rank in a hello topic's body (`rank` or `rank:token`)."""
    try:
        return int(body.split(b":", 1)[0])
    except ValueError:
        return None


def _admitter(admit_key: bytes, queue_id: bytes) -> Callable[[int, bytes], bool]:
    """Whether a subscriber's hello token admits reader `rank` to queue `queue_id`."""

    def admit(rank: int, token: bytes) -> bool:
        return hmac.compare_digest(token, admission_token(admit_key, queue_id, rank))

    return admit


class SocketSender(Sender):
    """Sends frames on one publisher, waiting at most until a deadline when subscribers lag.

    With a `sealer` (a TCP queue with a cluster secret) every message, control messages included, is
    sealed once (secure/aead.py) before it goes to every subscriber, and only subscribers that show their
    admission token are let in. Frames of ZERO_COPY_MIN bytes or more go to ZeroMQ without a copy: sealed
    ones are our own buffers (reused once ZeroMQ is done with them); plain ones are the caller's, so `send`
    returns only once ZeroMQ has let go of them.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        path: str,
        readers: list[int],
        hwm: int,
        endpoint: str = "",
        sealer: Sealer | None = None,
        admit: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        super().__init__()
        self.sock = sock
        self.path = path
        self.readers = readers
        self.hwm = hwm
        #: where subscribers connect (the bound address)
        self.endpoint = endpoint
        self.sealer = sealer
        #: an insecure stream's next sequence number (a sealed stream's is its sealer's)
        self.seq = 0
        self._admit = admit
        #: bytes this path has carried (the caller's frames, before sealing), for metrics
        self.sent_bytes = 0
        self._sndtimeo = -2  # unknown
        self._in_flight: list[tuple[zmq.MessageTracker, list[Any]]] = []
        self._raw = zmq_errors(f"enqueue to {path} readers")
        self._again = zmq_errors(f"enqueue to {path} readers", again=True)

    @classmethod
    def publish(cls, bind_to: str, path: str, readers: list[int], hwm: int, queue_id: bytes) -> SocketSender:
        """A publisher bound to `bind_to`; a TCP one with a cluster secret seals and admits by token."""
        sock, endpoint, manual = make_publisher(bind_to, sndhwm=hwm)
        sealer = admit = None
        if manual:
            secret = policy.process_secret()
            assert secret is not None
            sealer = Sealer(queue_key(secret.derive(b"queue-aead"), queue_id), queue_id)
            admit = _admitter(secret.derive(b"queue-admit"), queue_id)
        return cls(sock, path, readers, hwm, endpoint, sealer, admit)

    # -- sending -------------------------------------------------------------------------------

    def try_send(self, frames: list[Any], sizes: list[int] | None = None) -> bool:
        """The small one-frame message, now or not at all; anything else is `send`'s."""
        if len(frames) != 1:
            return False
        data = frames[0]
        if type(data) is not bytes or len(data) >= ZERO_COPY_MIN:  # (sealed, such a message stays one frame)
            return False
        sealer = self.sealer
        if sealer is not None:
            if self._in_flight:
                self._recycle()
            data = sealer.seal(frames)[0]
        else:
            data = _seq_pack(self.seq) + data
            self.seq += 1
        with self._again:
            self.sock.send(data, zmq.NOBLOCK)
            self.sent_bytes += len(frames[0])
            return True
        self._take_back()
        return False

    def _take_back(self) -> None:
        """A message that did not go: its sequence number is the next one's (the readers must not see a gap)."""
        if self.sealer is not None:
            self.sealer.seq -= 1
        else:
            self.seq -= 1

    def send(
        self,
        frames: list[Any],
        sizes: list[int] | None,
        deadline: float | None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """Without waiting if the readers keep up; else in slices, so a shutdown or the deadline ends it."""
        if sizes is None:
            sizes = frame_sizes(frames)
        sealer = self.sealer
        if sealer is not None:
            if self._in_flight:
                self._recycle()
            if sum(sizes) >= SEG_MIN:
                segmented = sealer.segments(frames)
                if segmented is not None:
                    self._send_segments(*segmented, deadline, on_wait)
                    self.sent_bytes += sum(sizes)
                    return
            frames = sealer.seal(frames)
        else:
            first = frames[0]
            frames = [_seq_pack(self.seq) + (first if type(first) is bytes else bytes(first)), *frames[1:]]
            self.seq += 1
        try:
            tracker = self._put_now(frames)
            if tracker is False:  # a reader is a full HWM behind: nothing was sent (ZeroMQ takes a message whole)
                tracker = self._send_waiting(frames, deadline, on_wait)
        except _NOT_SENT:
            self._take_back()
            raise
        self.sent_bytes += sum(sizes)
        if tracker is None:
            return
        if sealer is not None:
            self._in_flight.append((tracker, frames))
        else:
            self._wait_sent(tracker, deadline)

    def _put(self, frames: list[Any], flags: int) -> zmq.MessageTracker | None:
        """Hand one message to ZeroMQ; the big frames without a copy (then: a tracker of when it let go).
        Raw calls: the caller holds the error translation."""
        sock = self.sock
        last = len(frames) - 1
        tracked = []
        for i, f in enumerate(frames):
            more = zmq.SNDMORE if i < last else 0
            if (len(f) if type(f) is bytes else memoryview(f).nbytes) >= ZERO_COPY_MIN:
                frame = zmq.Frame(f, track=True)
                tracked.append(frame)
                sock.send(frame, (flags if i == 0 else 0) | more, copy=False)
            else:
                sock.send(f, (flags if i == 0 else 0) | more, copy=True)
        return zmq.MessageTracker(*tracked) if tracked else None

    def _put_now(self, frames: list[Any]) -> zmq.MessageTracker | None | bool:
        """`_put` without blocking; False if nothing could be sent now."""
        with self._again:
            return self._put(frames, zmq.NOBLOCK)
        return False

    def _send_segments(
        self, buf: bytearray, segments: Iterator[memoryview], deadline: float | None, on_wait: Callable[[], None] | None
    ) -> None:
        """A big sealed message, one ZeroMQ message per segment, each sent as soon as it is sealed (aead.py)."""
        trackers = []
        assert self.sealer is not None
        try:
            for seg in segments:
                tracker = self._put_now([seg])
                if tracker is False:
                    tracker = self._send_waiting([seg], deadline, on_wait)
                if tracker is not None:
                    trackers.append(tracker)
        except _NOT_SENT:
            self.sealer.seq -= 1  # the segment not sent: the readers must not see a gap (they drop the rest)
            raise
        finally:
            # the buffer is reused only once ZeroMQ is done with every segment that went out
            self._in_flight.append((zmq.MessageTracker(*trackers), [None, buf]))

    def _recycle(self) -> None:
        done = [x for x in self._in_flight if x[0].done]
        if done:
            assert self.sealer is not None
            self._in_flight = [x for x in self._in_flight if not x[0].done]
            for _, sealed in done:
                self.sealer.give_back(sealed)

    def _wait_sent(self, tracker: zmq.MessageTracker, deadline: float | None) -> None:
        """Until ZeroMQ has sent the caller's buffers (so the caller may change them once enqueue returns)."""
        if tracker.done:
            return
        self.wait(
            lambda s: True if tracker_done(tracker, s) else None,
            deadline,
            "enqueue",
            lambda _: (
                f" waiting for {self.path} reader rank(s) {self.readers} to take a message (its "
                f"buffers are still in use)"
            ),
        )

    def _send_waiting(
        self, frames: list[Any], deadline: float | None, on_wait: Callable[[], None] | None
    ) -> zmq.MessageTracker | None:
        def attempt(s: float) -> tuple[zmq.MessageTracker | None] | None:
            ms = max(1, int(s * 1000) + 1)
            with self._raw:
                if ms != self._sndtimeo:
                    self.sock.setsockopt(zmq.SNDTIMEO, ms)
                    self._sndtimeo = ms
            with self._again:
                return (self._put(frames, 0),)
            return None

        return self.wait(
            attempt,
            deadline,
            "enqueue",
            lambda _: (
                f" sending to {self.path} reader rank(s) {self.readers}: they are {self.hwm} messages behind "
                f"or unreachable"
            ),
            slice_s=SLICE_MS / 1000,
            on_wait=on_wait,
            log_level=logging.WARNING,
            log=lambda w: (
                f"writer has waited {w:.0f}s to send to {self.path} reader rank(s) {self.readers} "
                f"({self.hwm} messages behind, or unreachable)"
            ),
        )[0]

    def forward(self, frames: list[Any], deadline: float | None) -> None:
        """A message from another writer's stream, as it came off the wire (sealed, or with its sequence number):
        a relay passes it on unchanged, so its readers check it against the first writer's key and numbers."""
        if self._put_now(frames) is False:
            self._send_waiting(frames, deadline, None)
        self.sent_bytes += sum(len(f) for f in frames)

    def admit_to(self, queue_id: bytes) -> None:
        """A relay's publisher, once it knows the stream it passes on: admit that queue's readers by their
        tokens (on a cluster with a secret)."""
        secret = policy.process_secret()
        if secret is not None:
            self._admit = _admitter(secret.derive(b"queue-admit"), queue_id)

    def send_control(self, msg: bytes, block: bool) -> bool:
        """READY or CLOSE (sealed like any message on a sealed queue); False if it could not go now."""
        if self.sealer is None:
            frames, self.seq = [_seq_pack(self.seq) + msg], self.seq + 1
        else:
            frames = self.sealer.seal([msg])
        if block:
            with zmq_errors(f"sending {msg[len(CTRL) :].decode()} to {self.path} readers"):
                self._put(frames, 0)
            return True
        with zmq_errors(f"sending {msg[len(CTRL) :].decode()} to {self.path} readers", again=True):
            self._put(frames, zmq.NOBLOCK)
            return True
        self._take_back()
        return False

    # -- who is there ----------------------------------------------------------------------------

    def _reports(self, wait_s: float) -> Iterator[bytes]:
        """XPUB's subscription reports (b"\\x01" + topic on subscribe, b"\\x00" + topic on a drop), waiting up
        to `wait_s` for the first. Each is read only when the caller asks for it: an admission (SUBSCRIBE)
        applies to the pipe of the report read last."""
        with self._raw:
            if not self.sock.poll(int(wait_s * 1000), zmq.POLLIN):
                return
        while True:
            with self._again:
                msg = self.sock.recv(zmq.NOBLOCK)
                yield msg
                continue
            return

    def take_hellos(self, missing: set[int], wait_s: float) -> None:
        """Drop from `missing` the readers whose hello subscription arrived.

        On a publisher that admits by token, a hello with the rank's token subscribes the pipe it came on to
        every message, once per rank; any other subscription is left unanswered, so that peer gets nothing and
        its pipe never fills (it cannot hold the writer back)."""
        for msg in self._reports(wait_s):
            if msg[:1] != b"\x01" or not msg[1:].startswith(HELLO_PREFIX):
                continue
            body = msg[1 + len(HELLO_PREFIX) :]
            rank = hello_rank(body)
            if rank is None or rank not in missing:
                continue  # unknown, or already admitted: a replayed hello gets nothing
            if self._admit is not None:
                if not self._admit(rank, body.partition(b":")[2]):
                    logger.warning("refused a subscriber claiming to be reader %d without its token", rank)
                    continue
                with self._raw:
                    self.sock.setsockopt(zmq.SUBSCRIBE, b"")  # the pipe of the hello just read: every message
            missing.discard(rank)

    def read_close_acks(self, pending: set[int], wait_ms: int) -> None:
        """Remove from `pending` the readers that confirmed CLOSE or went away (see lingering.py); waits up to
        `wait_ms` for the first report."""
        for msg in self._reports(wait_ms / 1000):
            if msg[1 : 1 + len(HELLO_PREFIX)] != HELLO_PREFIX:
                continue
            rank = hello_rank(msg[1 + len(HELLO_PREFIX) :])
            if rank is None:
                continue
            if msg[:1] == b"\x00":
                pending.discard(rank)
            elif msg[:1] == b"\x01" and rank in self.readers:  # it reconnected: not confirmed after all
                pending.add(rank)

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """CLOSE to the readers, then the socket (with a short linger for it to go out)."""
        try:
            self.send_control(CLOSE, block=False)
        except TransportError:
            pass  # closing anyway: the readers see the disconnect instead
        self.sock.close(linger=100)

    def abort(self) -> None:
        self.sock.close(linger=0)
