"""The subscriber's end of the socket channel: one reader's messages from a ZeroMQ publisher (sender.py).

It blocks inside ZeroMQ for one slice (the hot path: no call but the receive),
then, idle, in a poll that a message, a shutdown (`Waker`) or a link event
ends, so a reader that waits for long costs nothing; the deadline and the
progress line come through the channel's one wait loop. It opens sealed messages before anything
else looks at them, and skips (and counts) what cannot be parsed. Each
message's sequence number must be the next one (insecure streams: 8 bytes
before frame 0; sealed ones: checked by the opener): anything else is
`OutOfSequence`, naming the stream and both numbers, never a skip.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from .. import serde
from ..channel import EMPTY, Receiver
from ..errors import BadFrame, OutOfSequence, QueueClosed
from ..secure import policy
from ..secure.aead import admission_token, queue_key
from ..secure.opener import Opener
from .link import LinkWatch
from .sender import CLOSE, CTRL, SEQ, SLICE_MS
from .sockets import HELLO_PREFIX, make_subscriber, zmq_errors
from .waker import Waker

__all__ = ["SocketReceiver"]

logger = logging.getLogger("rayfree.transport")

_perf = time.perf_counter
_loads = serde.loads
_seq_of = SEQ.unpack_from
_SEQ_LEN = SEQ.size
#: once a slice brought nothing, the longest one poll waits (a message, a shutdown or a link event ends it sooner)
IDLE_WAIT_S = 5.0


class SocketReceiver(Receiver):
    """Receives from one subscriber; blocks inside ZeroMQ, in slices, so shutdown is seen.

    No EVENTS polling or spinning: each such check is a syscall that competes
    with ZeroMQ's I/O thread for the core, which costs more than it saves.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        path: str,
        hello_topic: bytes | None = None,
        opener: Opener | None = None,
        endpoint: str = "",
    ) -> None:
        super().__init__()
        self.sock = sock
        self.path = path
        #: the writer's address, for the errors that name this stream
        self.endpoint = endpoint
        #: an insecure stream's next sequence number (a sealed one's is the opener's)
        self.expect = 0
        #: a sealed queue's messages are verified and decrypted (aead.py) before anything else looks at them
        self.opener = opener
        #: dropped when CLOSE is read: the writer's sign that this reader has every message
        self.hello_topic = hello_topic
        self._rcvtimeo = -2
        #: messages that could not be parsed, reported and skipped
        self.bad_frames = 0
        self._bad_logged_at = 0.0
        #: after the handshake, a remote reader watches its TCP link (watch_link)
        self._link: LinkWatch | None = None
        self._raw = zmq_errors("dequeue")
        self._again = zmq_errors("dequeue", again=True)
        self._waker = Waker()
        self._poller: zmq.Poller | None = None

    @classmethod
    def subscribe(cls, endpoint: str, path: str, rank: int, queue_id: str, maxmsgsize: int | None) -> SocketReceiver:
        """Reader `rank`'s subscriber; on TCP with a cluster secret it opens sealed messages and shows its token."""
        hello = str(rank).encode()
        opener = None
        secret = policy.process_secret() if path == "tcp" else None
        if secret is not None:  # a sealed queue: open every message, show the admission token
            qid = bytes.fromhex(queue_id)
            opener = Opener(queue_key(secret.derive(b"queue-aead"), qid), qid)
            hello += b":" + admission_token(secret.derive(b"queue-admit"), qid, rank)
        sock = make_subscriber(endpoint, hello, maxmsgsize=maxmsgsize)
        return cls(sock, path, HELLO_PREFIX + hello if path == "tcp" else None, opener, endpoint)

    def try_recv(self) -> Any:
        with self._again:
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            return self._message(frame, None, "dequeue")
        return EMPTY

    def recv(self, timeout: float | None, indefinite: bool = False) -> Any:
        # Straight into ZeroMQ's blocking receive: a look first would be one more call per message.
        return self.recv_waiting(None if timeout is None else _perf() + max(0.0, timeout), indefinite)

    def recv_waiting(self, deadline: float | None, indefinite: bool, what: str = "dequeue") -> Any:
        """The next good message as an object; one that cannot be parsed is reported and skipped
        (raises QueueClosed when the writer said CLOSE)."""
        while True:
            try:
                return self._message(self._next_frame(deadline, indefinite, what), deadline, what)
            except QueueClosed:
                self.ack_close()
                raise
            except BadFrame as e:
                self.bad_frames += 1
                now = _perf()
                if now - self._bad_logged_at > 5.0:  # one line per burst
                    self._bad_logged_at = now
                    logger.warning(
                        "%s: skipped a message that cannot be parsed (%s); %d so far", what, e, self.bad_frames
                    )

    def recv_control(self, deadline: float | None, what: str) -> list[Any]:
        """The next message's frames, as buffers (the handshake's READY)."""
        return self._rest(self._next_frame(deadline, True, what), what, deadline)

    def _next_frame(self, deadline: float | None, indefinite: bool, what: str) -> zmq.Frame:
        """The first frame of the next ZeroMQ message: one slice in ZeroMQ's blocking receive, then polls that
        a shutdown or a link event ends (the deadline and a log line come between them)."""
        first = True

        def attempt(s: float) -> zmq.Frame | None:
            nonlocal first
            if s <= 0:  # out of time: one last look, so a message that has arrived is read (timeout 0)
                with self._again:
                    return self.sock.recv(zmq.NOBLOCK, copy=False)
                return None
            if not first:
                return self._idle_look(s, what)
            first = False
            ms = int(min(s, SLICE_MS / 1000) * 1000) + 1
            with self._raw:
                if ms != self._rcvtimeo:
                    self.sock.setsockopt(zmq.RCVTIMEO, ms)
                    self._rcvtimeo = ms
            with self._again:
                return self.sock.recv(copy=False)
            if self._link is not None:
                self._link.check(what)
            return None

        return self.wait(
            attempt,
            deadline,
            what,
            lambda _: "",
            slice_s=IDLE_WAIT_S,
            log=None if indefinite else (lambda w: f"{what}: still waiting after {w:.0f}s"),
        )

    def _idle_look(self, s: float, what: str) -> zmq.Frame | None:
        """Up to `s` seconds in a poll of the socket, the waker and the link's monitor."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            self._poller.register(self._waker.fd, zmq.POLLIN)
            if self._link is not None:
                self._poller.register(self._link.monitor, zmq.POLLIN)
        link = self._link
        if link is not None:
            s = min(s, link.left())
        with self._raw:
            events = dict(self._poller.poll(int(s * 1000) + 1))
        if self.sock in events:
            with self._again:
                return self.sock.recv(zmq.NOBLOCK, copy=False)
        if self._waker.fd in events:
            self._waker.drain()
        if link is not None:
            link.check(what, force=True)
        return None

    def shutdown(self) -> None:
        super().shutdown()
        self._waker.wake()  # a wait in `_idle_look` ends now

    def _message(self, frame: zmq.Frame, deadline: float | None, what: str) -> Any:
        """The object of the message that begins with `frame`."""
        if not frame.more:  # the common small message, with the least work
            buf = frame.buffer
            opener = self.opener
            if opener is None:
                buf = self._in_order(buf)
            else:
                try:
                    buf = opener.open_one(buf)
                except OutOfSequence as e:
                    raise self.out_of_sequence(e.seq, e.expected) from None
                if buf is None:  # not the common kind: the general path judges it
                    return self.decode(self._rest(frame, what, deadline))
            if buf[:4] != CTRL:
                try:
                    return _loads(buf)
                except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad frame
                    raise BadFrame(f"could not decode a 1-frame message: {type(e).__name__}: {e}") from e
            return self.decode([buf])
        return self.decode(self._rest(frame, what, deadline))

    def _parts(self, frame: zmq.Frame) -> list[Any]:
        parts: list[Any] = [frame.buffer]
        with self._raw:
            while frame.more:
                frame = self.sock.recv(copy=False)
                parts.append(frame.buffer)
        return parts

    def _rest(self, frame: zmq.Frame, what: str, deadline: float | None = None) -> list[Any]:
        """The message that begins with `frame`, opened if the queue is sealed (a segmented one: every segment)."""
        parts = self._parts(frame)
        opener = self.opener
        if opener is None:
            parts[0] = self._in_order(parts[0])
            return parts
        try:
            out = opener.open(parts)
            while out is None:  # the next segment is on its way (or already here)
                out = opener.open(self._parts(self._next_frame(deadline, True, what)))
        except OutOfSequence as e:
            raise self.out_of_sequence(e.seq, e.expected) from None
        return out

    def recv_wire(self, deadline: float | None, what: str) -> list[zmq.Frame]:
        """The next ZeroMQ message as it came off the wire (a relay forwards it as is, then `open_wire`s it)."""
        frame = self._next_frame(deadline, True, what)
        frames = [frame]
        with self._raw:
            while frame.more:
                frame = self.sock.recv(copy=False)
                frames.append(frame)
        return frames

    def open_wire(self, frames: list[zmq.Frame]) -> list[Any] | None:
        """A wire message's plaintext frames, checked to be next in order (None: a segment of a sealed message
        whose rest is still to come; BadFrame: not genuine, skip it)."""
        parts: list[Any] = [f.buffer for f in frames]
        if self.opener is None:
            parts[0] = self._in_order(parts[0])
            return parts
        try:
            return self.opener.open(parts)
        except OutOfSequence as e:
            raise self.out_of_sequence(e.seq, e.expected) from None

    def _in_order(self, buf: Any) -> Any:
        """An insecure message's first frame without its sequence number, which must be the next one."""
        if len(buf) < _SEQ_LEN:
            raise BadFrame(f"a {len(buf)}-byte message, shorter than its sequence number")
        (seq,) = _seq_of(buf)
        if seq != self.expect:
            raise self.out_of_sequence(seq, self.expect)
        self.expect = seq + 1
        return buf[_SEQ_LEN:]

    def out_of_sequence(self, seq: int, expect: int) -> OutOfSequence:
        what = f"{expect - seq} message(s) repeated or reordered" if seq < expect else f"{seq - expect} lost"
        sealed = "sealed " if self.opener is not None else ""
        return OutOfSequence(
            f"the {sealed}{self.path} stream from {self.endpoint or 'its writer'} to this reader: message {seq} "
            f"arrived where {expect} was due ({what}); the queue cannot go on",
            seq,
            expect,
        )

    @staticmethod
    def decode(parts: list[Any]) -> Any:
        first = parts[0]
        if first[:4] == CTRL:
            if len(parts) == 1 and first == CLOSE:
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            raise BadFrame(f"unexpected control message {bytes(first[:32])!r}")
        try:
            return _loads(first, buffers=parts[1:])
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad frame
            raise BadFrame(f"could not decode a {len(parts)}-frame message: {type(e).__name__}: {e}") from e

    def watch_link(self, endpoint: str) -> None:
        """A remote reader, once READY: notice when its TCP connection to the writer drops (link.py)."""
        self._link = LinkWatch(self.sock, endpoint, SLICE_MS / 1000)
        self._poller = None  # made again, with the link's monitor

    def ack_close(self) -> None:
        """Tell the writer this reader has read its CLOSE (by dropping the hello topic)."""
        topic, self.hello_topic = self.hello_topic, None
        if topic is not None:
            with zmq_errors("", ignore=True):  # closing anyway; on an error the writer sees the disconnect instead
                self.sock.setsockopt(zmq.UNSUBSCRIBE, topic)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        self._poller = None
        self.sock.close(linger=0)
        self._waker.close()
