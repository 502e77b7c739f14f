"""The socket channel of a MessageQueue: frames over ZeroMQ pub/sub (remote readers over TCP; a ring's overflow over ipc).

A message is one multipart ZeroMQ message: frame 0 the pickle stream, the
rest out-of-band buffers (see serde.py). A single frame that starts with
`CTRL` is a control message (READY, CLOSE); one that starts with `RAW` is a
small bytes message sent without pickle. A pickle stream starts with neither.

Both ends keep the Python work around each send and receive small: on a
machine with few cores, every microsecond spent there is a microsecond that
ZeroMQ's own I/O thread waits for a core.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import zmq

from rayfree import settings

from . import serde
from .aead import SEG_MIN, Opener, Sealer
from .channel import Receiver, Sender
from .errors import BadFrame, QueueBroken, QueueClosed, QueueShutdown, QueueTimeout, TransportError
from .sockets import translate
from .waiting import Waiters

logger = logging.getLogger("rayfree.transport")

CTRL = b"\x00RF:"
READY = CTRL + b"READY"
CLOSE = CTRL + b"CLOSE"
RAW = b"\x01"
#: Bytes messages up to this size go raw; bigger ones go out-of-band (serde.py).
RAW_MAX_BYTES = 4096
#: A blocked receive re-checks for shutdown this often.
SLICE_MS = 100
#: Frames at least this big go to ZeroMQ without a copy.
ZERO_COPY_MIN = 64 << 10

_perf = time.perf_counter
_loads = serde.loads
#: What a send raises only before ZeroMQ took the message: then its sequence number is taken back. Anything else
#: (a KeyboardInterrupt just after ZeroMQ took it) keeps the number spent: a gap the readers report beats a GCM
#: nonce used twice.
_NOT_SENT = (QueueTimeout, QueueShutdown, zmq.ZMQError)


class SocketSender(Sender):
    """Sends frames on one publisher, waiting at most until a deadline when subscribers lag.

    With a `sealer` (a TCP queue with a cluster secret) every message, control messages included, is
    sealed once (aead.py) before it goes to every subscriber. Frames of ZERO_COPY_MIN bytes or more go
    to ZeroMQ without a copy: sealed ones are our own buffers (reused once ZeroMQ is done with them);
    plain ones are the caller's, so `send` returns only once ZeroMQ has let go of them.
    """

    def __init__(self, sock: zmq.Socket, path: str, readers: list[int], hwm: int,
                 sealer: Sealer | None = None) -> None:
        self.sock = sock
        self.path = path
        self.readers = readers
        self.hwm = hwm
        self.sealer = sealer
        self.shutdown_requested = False
        self.waiters = Waiters()
        self.log_interval = settings.get("RAYFREE_WAIT_LOG_INTERVAL_S")
        self._sndtimeo = -2  # unknown
        self._in_flight: list[tuple[zmq.MessageTracker, list]] = []

    def send(self, frames: list, sizes: list[int] | None, deadline: float | None,
             on_wait: Callable[[], None] | None = None) -> None:
        """Without waiting if the readers keep up; else in slices, so a shutdown or the deadline ends it."""
        if self.sealer is not None:
            if self._in_flight:
                self._recycle()
            if len(frames) > 1 or len(frames[0]) >= SEG_MIN:
                if sizes is None:
                    sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
                if sum(sizes) >= SEG_MIN:  # (below it, `segments` would only measure the frames seal() measures)
                    segmented = self.sealer.segments(frames)
                    if segmented is not None:
                        return self._send_segments(*segmented, deadline, on_wait)
            frames = self.sealer.seal(frames)
        if len(frames) == 1 and len(frames[0]) < ZERO_COPY_MIN:  # the common small message: one call
            try:
                self.sock.send(frames[0], zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                raise translate(e, f"enqueue to {self.path} readers") from e
        try:
            tracker = self._put(frames, zmq.NOBLOCK)
        except zmq.Again:  # a reader is a full HWM behind: nothing was sent (ZeroMQ takes a message whole)
            try:
                tracker = self._send_waiting(frames, deadline, on_wait)
            except _NOT_SENT:
                if self.sealer is not None:
                    self.sealer.seq -= 1  # not sent: the readers must not see a gap
                raise
        except zmq.ZMQError as e:
            raise translate(e, f"enqueue to {self.path} readers") from e
        if tracker is None:
            return
        if self.sealer is not None:
            self._in_flight.append((tracker, frames))
        else:
            self._wait_sent(tracker, deadline)

    def _put(self, frames: list, flags: int) -> zmq.MessageTracker | None:
        """Hand one message to ZeroMQ; the big frames without a copy (then: a tracker of when it let go)."""
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

    def _send_segments(self, buf: bytearray, segments: Iterator[memoryview], deadline: float | None,
                       on_wait: Callable[[], None] | None) -> None:
        """A big sealed message, one ZeroMQ message per segment, each sent as soon as it is sealed (aead.py)."""
        trackers = []
        try:
            for seg in segments:
                try:
                    tracker = self._put([seg], zmq.NOBLOCK)
                except zmq.Again:
                    tracker = self._send_waiting([seg], deadline, on_wait)
                if tracker is not None:
                    trackers.append(tracker)
        except _NOT_SENT as e:
            self.sealer.seq -= 1  # the segment not sent: the readers must not see a gap (they drop the rest)
            if isinstance(e, zmq.ZMQError) and not isinstance(e, TransportError):
                raise translate(e, f"enqueue to {self.path} readers") from e
            raise
        finally:
            # the buffer is reused only once ZeroMQ is done with every segment that went out
            self._in_flight.append((zmq.MessageTracker(*trackers), [None, buf]))

    def _recycle(self) -> None:
        done = [x for x in self._in_flight if x[0].done]
        if done:
            self._in_flight = [x for x in self._in_flight if not x[0].done]
            for _, sealed in done:
                self.sealer.give_back(sealed)

    def _wait_sent(self, tracker: zmq.MessageTracker, deadline: float | None) -> None:
        """Until ZeroMQ has sent the caller's buffers (so the caller may change them once enqueue returns)."""
        while not tracker.done:
            if self.shutdown_requested:
                raise QueueShutdown("enqueue interrupted: shutdown() was called on this queue")
            left = 0.1 if deadline is None else min(0.1, deadline - _perf())
            if left <= 0:
                raise QueueTimeout(f"enqueue timed out waiting for {self.path} reader rank(s) {self.readers} to take "
                                   f"a message (its buffers are still in use)")
            try:
                tracker.wait(left)
            except zmq.NotDone:
                pass

    def send_raw(self, data: bytes) -> None:
        """A small bytes message, without pickle."""
        self.send([RAW + data], None, None)

    def _send_waiting(self, frames: list, deadline: float | None,
                      on_wait: Callable[[], None] | None) -> zmq.MessageTracker | None:
        sock = self.sock
        t0 = _perf()
        next_log = t0 + self.log_interval
        with self.waiters:
            while True:
                if self.shutdown_requested:
                    raise QueueShutdown("enqueue interrupted: shutdown() was called on this queue")
                now = _perf()
                if deadline is not None and now >= deadline:
                    raise QueueTimeout(f"enqueue timed out after {now - t0:.3f}s sending to {self.path} reader "
                                       f"rank(s) {self.readers}: they are {self.hwm} messages behind or unreachable")
                if now >= next_log:
                    logger.warning("writer has waited %.0fs to send to %s reader rank(s) %s (%d messages behind, or "
                                   "unreachable)", now - t0, self.path, self.readers, self.hwm)
                    next_log = now + self.log_interval
                ms = SLICE_MS if on_wait is None else 5
                if deadline is not None:
                    ms = max(1, min(ms, int((deadline - now) * 1000) + 1))
                if ms != self._sndtimeo:
                    sock.setsockopt(zmq.SNDTIMEO, ms)
                    self._sndtimeo = ms
                try:
                    return self._put(frames, 0)
                except zmq.Again:
                    if on_wait is not None:
                        on_wait()
                except zmq.ZMQError as e:
                    raise translate(e, f"enqueue to {self.path} readers") from e

    def send_control(self, msg: bytes, block: bool) -> bool:
        """READY or CLOSE (sealed like any message on a sealed queue); False if it could not go now."""
        frames = [msg] if self.sealer is None else self.sealer.seal([msg])
        try:
            self._put(frames, 0 if block else zmq.NOBLOCK)
            return True
        except zmq.Again:
            if self.sealer is not None:
                self.sealer.seq -= 1  # not sent: the readers must not see a gap
            return False
        except zmq.ZMQError as e:
            if block:
                raise translate(e, f"sending {msg[len(CTRL):].decode()} to {self.path} readers") from e
            return False

    def read_close_acks(self, pending: set[int], hello_prefix: bytes, wait_ms: int) -> None:
        """Remove from `pending` the readers that confirmed CLOSE or went away (see lingering.py);
        waits up to `wait_ms` for the first report."""
        sock = self.sock
        if not sock.poll(wait_ms, zmq.POLLIN):
            return
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # XPUB reports 0x01 + topic per subscription and 0x00 + topic when one is dropped.
            if msg[1:1 + len(hello_prefix)] != hello_prefix:
                continue
            rank = hello_rank(msg[1 + len(hello_prefix):])
            if rank is None:
                continue
            if msg[:1] == b"\x00":
                pending.discard(rank)
            elif msg[:1] == b"\x01" and rank in self.readers:  # it reconnected: not confirmed after all
                pending.add(rank)

    def shutdown(self) -> None:
        self.shutdown_requested = True  # a blocked send sees it within SLICE_MS

    def close(self) -> None:
        """CLOSE to the readers, then the socket (with a short linger for it to go out)."""
        self.send_control(CLOSE, block=False)
        self.sock.close(linger=100)

    def abort(self) -> None:
        self.sock.close(linger=0)


def hello_rank(body: bytes) -> int | None:
    """The rank in a hello topic's body (`rank` or `rank:token`)."""
    try:
        return int(body.split(b":", 1)[0])
    except ValueError:
        return None


class SocketReceiver(Receiver):
    """Receives from one subscriber; blocks inside ZeroMQ, in slices, so shutdown is seen.

    No EVENTS polling or spinning: each such check is a syscall that competes
    with ZeroMQ's I/O thread for the core, which costs more than it saves.
    """

    def __init__(self, sock: zmq.Socket, path: str, hello_topic: bytes | None = None,
                 opener: Opener | None = None) -> None:
        self.sock = sock
        self.path = path
        #: a sealed queue's messages are verified and decrypted (aead.py) before anything else looks at them
        self.opener = opener
        #: dropped when CLOSE is read: the writer's sign that this reader has every message
        self.hello_topic = hello_topic
        self.shutdown_requested = False
        self.waiters = Waiters()
        self._rcvtimeo = -2
        #: messages that could not be parsed, reported and skipped
        self.bad_frames = 0
        self._bad_logged_at = 0.0
        self.log_interval = settings.get("RAYFREE_WAIT_LOG_INTERVAL_S")
        #: after the handshake, a remote reader watches its TCP link (watch_link)
        self._monitor: zmq.Socket | None = None
        self._link_check_at = 0.0
        self._lost_at: float | None = None
        self._grace = 0.0

    def recv(self, timeout: float | None, indefinite: bool, what: str = "dequeue") -> Any:
        """The next good message as an object; one that cannot be parsed is reported and skipped
        (raises QueueClosed when the writer said CLOSE)."""
        deadline = None if timeout is None else _perf() + timeout
        while True:
            try:
                return self._get(timeout, indefinite, what)
            except QueueClosed:
                self.ack_close()
                raise
            except BadFrame as e:
                self.bad_frames += 1
                now = _perf()
                if now - self._bad_logged_at > 5.0:  # one line per burst
                    self._bad_logged_at = now
                    logger.warning("%s: skipped a message that cannot be parsed (%s); %d so far", what, e,
                                   self.bad_frames)
                if deadline is not None:
                    timeout = max(0.0, deadline - now)

    def _get(self, timeout: float | None, indefinite: bool, what: str) -> Any:
        if timeout is None and self._rcvtimeo == SLICE_MS:
            try:
                with self.waiters:
                    frame = self.sock.recv(copy=False)
            except zmq.Again:
                return self.decode(self.recv_frames(None, indefinite, what))
            if not frame.more:  # the common small message, with the least work
                buf = frame.buffer
                opener = self.opener
                if opener is not None:
                    buf = opener.open_one(buf)
                    if buf is None:  # not the common kind: the general path judges it
                        return self.decode(self._rest(frame, what))
                if buf[:1] == RAW:
                    return bytes(buf[1:])
                if buf[:4] != CTRL:
                    try:
                        return _loads(buf)
                    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad frame
                        raise BadFrame(f"could not decode a 1-frame message: {type(e).__name__}: {e}") from e
                return self.decode([buf])
            return self.decode(self._rest(frame, what))
        deadline = None if timeout is None else _perf() + timeout
        return self.decode(self.recv_frames(deadline, indefinite, what))

    def recv_frames(self, deadline: float | None, indefinite: bool, what: str) -> list:
        """The next message's frames, as buffers."""
        with self.waiters:
            return self._recv(deadline, indefinite, what)

    def _recv(self, deadline: float | None, indefinite: bool, what: str) -> list:
        return self._rest(self._recv_frame(deadline, indefinite, what), what, deadline)

    def _recv_frame(self, deadline: float | None, indefinite: bool, what: str) -> zmq.Frame:
        """The first frame of the next ZeroMQ message, waiting in slices (shutdown, deadline, a log line)."""
        sock = self.sock
        t0 = _perf()
        next_log = t0 + self.log_interval
        while True:
            if self.shutdown_requested:
                raise QueueShutdown(f"{what} interrupted: shutdown() was called on this queue")
            ms = SLICE_MS
            flags = 0
            if deadline is not None:
                left = deadline - _perf()
                if left <= 0:  # out of time: one last look, so a message that has arrived is read (timeout 0)
                    flags = zmq.NOBLOCK
                ms = min(ms, int(left * 1000) + 1)
            if not flags and ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, ms)
                self._rcvtimeo = ms
            try:
                return sock.recv(flags, copy=False)
            except zmq.Again:
                if flags:
                    raise QueueTimeout(f"{what} timed out after {_perf() - t0:.3f}s") from None
                now = _perf()
                if self._monitor is not None and now >= self._link_check_at:
                    self._check_link(now, what)
                if now >= next_log:
                    if not indefinite:
                        logger.info("%s: still waiting after %.0fs", what, now - t0)
                    next_log = now + self.log_interval
                continue
            except zmq.ZMQError as e:
                raise translate(e, what) from e

    def _parts(self, frame: zmq.Frame, what: str) -> list:
        parts: list = [frame.buffer]
        try:
            while frame.more:
                frame = self.sock.recv(copy=False)
                parts.append(frame.buffer)
        except zmq.ZMQError as e:
            raise translate(e, what) from e
        return parts

    def _rest(self, frame: zmq.Frame, what: str, deadline: float | None = None) -> list:
        """The message that begins with `frame`, opened if the queue is sealed (a segmented one: every segment)."""
        parts = self._parts(frame, what)
        opener = self.opener
        if opener is None:
            return parts
        out = opener.open(parts)
        while out is None:  # the next segment is on its way (or already here)
            out = opener.open(self._parts(self._recv_frame(deadline, True, what), what))
        return out

    @staticmethod
    def decode(parts: list) -> Any:
        first = parts[0]
        if first[:1] == RAW and len(parts) == 1:
            return bytes(first[1:])
        if first[:4] == CTRL:
            if len(parts) == 1 and first == CLOSE:
                raise QueueClosed("the writer closed this queue; no more messages will arrive")
            raise BadFrame(f"unexpected control message {bytes(first[:32])!r}")
        try:
            return _loads(first, buffers=parts[1:])
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad frame
            raise BadFrame(f"could not decode a {len(parts)}-frame message: {type(e).__name__}: {e}") from e

    def watch_link(self, endpoint: str) -> None:
        """A remote reader, once READY: notice when its TCP connection to the writer drops.

        ZeroMQ reconnects by itself, but the writer admits each reader once (aead.py), and what was sent
        while the link was down is gone either way; so a reader that lost its link and then waits
        RAYFREE_LINK_GRACE_S for a message raises QueueBroken instead of waiting forever. The check runs
        only while the reader waits (every SLICE_MS at most), never on a message's path; the grace lets
        the cluster's heartbeats name a lost node first.
        """
        self._grace = settings.get("RAYFREE_LINK_GRACE_S")
        self._endpoint = endpoint
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def _check_link(self, now: float, what: str) -> None:
        self._link_check_at = now + SLICE_MS / 1000
        mon = self._monitor
        try:
            while mon.poll(0):
                mon.recv_multipart(zmq.NOBLOCK)  # the only event it reports is EVENT_DISCONNECTED
                if self._lost_at is None:
                    self._lost_at = now
                    logger.warning("%s: the TCP connection to the writer (%s) dropped; messages sent meanwhile are "
                                   "lost, and the writer does not take this reader back", what, self._endpoint)
        except zmq.ZMQError:
            return
        if self._lost_at is not None and now - self._lost_at >= self._grace:
            raise QueueBroken(f"{what}: this reader's TCP connection to the writer ({self._endpoint}) dropped "
                              f"{now - self._lost_at:.1f}s ago and no message has come since: what was sent "
                              f"meanwhile is lost and the writer does not take a reconnected reader back. Check "
                              f"the network between this node and the writer's, then restart the cluster.")

    def ack_close(self) -> None:
        """Tell the writer this reader has read its CLOSE (by dropping the hello topic)."""
        topic, self.hello_topic = self.hello_topic, None
        if topic is not None:
            try:
                self.sock.setsockopt(zmq.UNSUBSCRIBE, topic)
            except zmq.ZMQError:
                pass  # closing anyway; the writer sees the disconnect instead

    def shutdown(self) -> None:
        self.shutdown_requested = True  # a blocked receive sees it within SLICE_MS

    def close(self) -> None:
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        self.sock.close(linger=0)
