"""A sealed queue's reader side: verify and decrypt every message into this reader's own buffers, in order.

The wire format and the key and nonce rules are aead.py's; nothing is handed on before its tag is verified,
and a message forged, tampered, truncated, replayed, reordered, or from another queue or cluster is counted
and refused unread.
"""

from __future__ import annotations

import logging
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import BadFrame, OutOfSequence
from ..shm.bulk import BufferPool
from .aead import (
    _ALIGN,
    _HEAD,
    _HEAD_ONE1,
    _MAX_FRAMES,
    _SEG_BOUND,
    _SEG_CONT,
    _SEG_HEAD,
    _SMALL,
    _TAG,
    MAGIC,
    MAGIC_CONT,
    MAGIC_ONE,
    MAGIC_SEG,
    _nonce,
    plan,
)

__all__ = ["Opener"]

logger = logging.getLogger("rayfree.transport")


class Opener:
    """A reader's side: verifies and decrypts into this reader's own buffers, in order, or refuses."""

    def __init__(self, key: bytes, queue_id: bytes, pool_limit: int = 128 << 20) -> None:
        self._alg = algorithms.AES(key)
        self._aead = AESGCM(key)
        self._qid = queue_id
        self.expect = 0
        self.pool = BufferPool(pool_limit)
        #: a segmented message being received: [buffer view, lengths, offsets, segments, next index]
        self._partial: list | None = None
        #: segmented messages dropped unfinished (their writer gave up on them mid-way)
        self.cut_short = 0

    def open_one(self, msg) -> bytes | None:
        """The plaintext of the commonest message (one frame of one frame under 64 KiB: a step's call, a reply)
        when it is genuine and next in order, with the least work; None for any other message, which `open`
        then judges (BadFrame when it fails the tag)."""
        if len(msg) < _HEAD_ONE1.size + _TAG or self._partial is not None:
            return None
        magic, seq, n, size = _HEAD_ONE1.unpack_from(msg)
        if magic != MAGIC_ONE or n != 1 or seq != self.expect or size != len(msg) - _HEAD_ONE1.size - _TAG:
            return None
        try:
            pt = self._aead.decrypt(_nonce(seq), msg[_HEAD_ONE1.size :], self._qid + bytes(msg[: _HEAD_ONE1.size]))
        except InvalidTag:
            raise _forged() from None
        self.expect = seq + 1
        return pt

    def open(self, parts: list) -> list | None:
        """The message's plaintext frames, or None after a segment of an unfinished segmented message (pass
        the next ZeroMQ message); BadFrame (nothing else is touched) when it is not genuine."""
        if not parts:
            raise BadFrame("an empty message")
        first = parts[0]
        if len(parts) == 1:
            pt = self.open_one(first)
            if pt is not None:
                return [pt]
        magic = bytes(first[:4])
        if magic == MAGIC_ONE and len(first) >= _HEAD.size + _TAG:
            return self._open_one(first, len(parts))
        if magic == MAGIC_CONT:
            return self._open_cont(first, len(parts))
        if magic == MAGIC_SEG:
            return self._open_head(first, len(parts))
        if len(first) < _HEAD.size + _TAG or magic != MAGIC:
            raise BadFrame("not a sealed rayfree message (wrong magic or length)")
        head = bytes(first)
        _, seq, n = _HEAD.unpack_from(head)
        if n != len(parts) - 1 or len(head) != _HEAD.size + 8 * n + _TAG:
            raise BadFrame(f"a sealed message with {len(parts) - 1} frame(s) whose header says {n}")
        lengths = struct.unpack_from(f"<{n}Q", head, _HEAD.size)
        if any(memoryview(p).nbytes != ln for p, ln in zip(parts[1:], lengths)):
            raise BadFrame("a sealed message whose frame lengths do not match its header (truncated?)")
        dec = Cipher(self._alg, modes.GCM(_nonce(seq), head[-_TAG:])).decryptor()
        dec.authenticate_additional_data(self._qid + head[:-_TAG])
        out = []
        for p, ln in zip(parts[1:], lengths):
            if ln < _SMALL:
                buf = bytearray(ln + 15)
                dec.update_into(p, buf)
                out.append(memoryview(buf)[:ln])
            else:
                view, _ = self.pool.take(ln + 15)
                dec.update_into(p, view)
                out.append(view[:ln])
        try:
            dec.finalize()
        except InvalidTag:
            raise _forged() from None
        self._check_order(seq)
        if self._partial is not None:
            self._drop_partial()
        return out

    def _open_head(self, msg, nparts: int) -> list | None:
        """The first segment of a segmented message: its layout, and the first of its bytes."""
        mv = msg if isinstance(msg, memoryview) else memoryview(msg)
        if nparts != 1 or len(mv) < _SEG_HEAD.size + _TAG:
            raise BadFrame("a segment that is not one frame, or is truncated")
        _, seq, nseg, n, seg = _SEG_HEAD.unpack_from(mv)
        hl = _SEG_HEAD.size + 8 * n
        if not 0 < n <= _MAX_FRAMES or not 0 < seg <= _SEG_BOUND or len(mv) < hl + _TAG:
            raise BadFrame("a segmented message whose head is malformed")
        try:  # first the tag: nothing in the head (the layout, the buffer's size) is used before it passed
            first = self._aead.decrypt(_nonce(seq), mv[hl:], self._qid + bytes(mv[:hl]))
        except InvalidTag:
            raise _forged() from None
        self._check_order(seq)
        lengths = struct.unpack_from(f"<{n}Q", mv, _SEG_HEAD.size)
        offs, size, segs = plan(lengths, seg)
        b, e = segs[0][0], segs[0][1]
        if len(segs) != nseg or len(first) != e - b:
            raise BadFrame("a segmented message whose head does not match its layout")
        view, addr = self.pool.take(size + _ALIGN - 1)
        view = view[-addr % _ALIGN :]  # frame offsets are 64-byte aligned in memory too
        view[b:e] = first  # the head usually carries only the small frames (the pickle stream)
        if self._partial is not None:
            self._drop_partial()
        self._partial = [view, lengths, offs, segs, 1]
        return self._finish() if nseg == 1 else None

    def _open_cont(self, msg, nparts: int) -> list | None:
        """A later segment of the message being received."""
        mv = msg if isinstance(msg, memoryview) else memoryview(msg)
        if nparts != 1 or len(mv) < _SEG_CONT.size + _TAG:
            raise BadFrame("a segment that is not one frame, or is truncated")
        _, seq, k = _SEG_CONT.unpack_from(mv)
        part = self._partial
        if part is None or k != part[4]:
            try:  # genuine, then out of order (the stream is broken); else a forgery to skip
                self._aead.decrypt(_nonce(seq), mv[_SEG_CONT.size :], self._qid + bytes(mv[: _SEG_CONT.size]))
            except InvalidTag:
                raise BadFrame(f"segment {k} of a segmented message whose earlier segments did not arrive") from None
            self._check_order(seq)
            raise BadFrame(f"segment {k} of a segmented message whose earlier segments did not arrive")
        view, segs = part[0], part[3]
        b, e = segs[k][0], segs[k][1]
        if len(mv) != _SEG_CONT.size + e - b + _TAG:
            raise BadFrame("a segment whose length does not match its message's layout (truncated?)")
        try:
            self._aead.decrypt_into(
                _nonce(seq), mv[_SEG_CONT.size :], self._qid + bytes(mv[: _SEG_CONT.size]), view[b:e]
            )
        except InvalidTag:
            raise _forged() from None
        self._check_order(seq)
        part[4] = k + 1
        return self._finish() if k + 1 == len(segs) else None

    def _drop_partial(self) -> None:
        """A genuine message began while a segmented one was unfinished: its writer gave up on that one."""
        self._partial = None
        self.cut_short += 1
        logger.warning(
            "dropped a segmented message its writer did not finish sending (it gave up on it mid-way); %d so far",
            self.cut_short,
        )

    def _finish(self) -> list:
        view, lengths, offs, _, _ = self._partial  # type: ignore[misc]
        self._partial = None
        return [view[o : o + n] for o, n in zip(offs, lengths)]

    def _check_order(self, seq: int) -> None:
        """A genuine message (its tag passed) must be the next: else one was lost, repeated or reordered, and
        the stream is broken (OutOfSequence), not skipped past. The next one is due only once this one is."""
        if seq != self.expect:
            raise OutOfSequence(f"sealed message {seq} arrived where {self.expect} was due", seq, self.expect)
        self.expect = seq + 1

    def _open_one(self, msg, nparts: int) -> list:
        """A one-frame sealed message: header, the ciphertext of every frame joined, tag."""
        _, seq, n = _HEAD.unpack_from(msg)
        hlen = _HEAD.size + 8 * n
        size = len(msg)
        if nparts != 1 or size < hlen + _TAG:
            raise BadFrame("a one-frame sealed message that is not one frame, or is truncated")
        lengths = struct.unpack_from(f"<{n}Q", msg, _HEAD.size)
        if sum(lengths) != size - hlen - _TAG:
            raise BadFrame("a sealed message whose length does not match its header (truncated?)")
        mv = msg if isinstance(msg, memoryview) else memoryview(msg)
        try:
            pt = self._aead.decrypt(_nonce(seq), mv[hlen:], self._qid + bytes(mv[:hlen]))
        except InvalidTag:
            raise _forged() from None
        self._check_order(seq)
        if self._partial is not None:
            self._drop_partial()
        if n == 1:
            return [pt]  # one frame: a pickle stream (or a control or raw message), read, never written to
        view = memoryview(bytearray(pt))  # writable, like every out-of-band buffer a reader gets
        out, off = [], 0
        for ln in lengths:
            out.append(view[off : off + ln])
            off += ln
        return out


def _forged() -> BadFrame:
    return BadFrame("a sealed message that fails authentication (forged, tampered, or from another queue or cluster)")
