"""Sealing a queue's TCP messages once, for every subscriber: AES-256-GCM keyed from the cluster secret.

CURVE (what ZeroMQ offers) encrypts a publisher's message once per
subscriber, in ZeroMQ's single I/O thread: 4 readers cost 4 encryptions,
and 32 MiB cost ~100 ms here. Instead the writer seals each message once
(AES-GCM through `cryptography`, which uses the CPU's AES instructions:
~10 GB/s here into warm memory) and publishes the sealed frames to every
admitted subscriber; each reader opens it into its own buffers.

Wire format of a sealed message: frame 0 is the header
`MAGIC | u64 seq | u32 n | u64 length[n] | 16-byte tag`, frames 1..n the
ciphertexts of the message's frames, one GCM stream over all of them. A
message under 64 KiB in all travels as one frame: the header (with
MAGIC_ONE, no tag), then the ciphertext of its frames joined, then the tag
(AES-GCM's own output, so neither side reassembles it).
The key is per queue (HMAC of the cluster's data key and the queue id), the
nonce is the sequence number, and the header is authenticated data. A reader
accepts exactly the next sequence number: a message forged, tampered,
truncated, replayed, reordered, or from another queue or cluster fails the
tag or the order check, is counted and skipped, and is never unpickled
(nothing is handed on before the tag is verified).

Subscribers are admitted only with a token derived from the secret, the
queue id and their rank (sockets.py, writer.py), once per rank: a peer
without the secret gets no messages, so it cannot stall the writer either.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import BadFrame
from .pool import BufferPool

__all__ = ["Sealer", "Opener", "queue_key", "admission_token", "MAGIC"]

MAGIC = b"RFA1"
MAGIC_ONE = b"RFA2"
_HEAD = struct.Struct("<4sQI")
_HEAD_ONE1 = struct.Struct("<4sQIQ")  # a one-frame message of one frame: the commonest, packed in one call
_TAG = 16
_SMALL = 1 << 16  # frames below this get a plain bytearray; bigger ones a warm pooled buffer
# A message smaller than this in all is sealed in one call over its joined frames (~1 us, where setting up a
# streaming cipher costs ~10); the ciphertext and tag are the same either way (GCM over the concatenation).
_ONE_SHOT = 1 << 16


def queue_key(data_key: bytes, queue_id: bytes) -> bytes:
    """The queue's own AES-256 key: nonces (sequence numbers) then never repeat under one key."""
    return hmac.new(data_key, b"rayfree/queue-key/" + queue_id, hashlib.sha256).digest()


def admission_token(admit_key: bytes, queue_id: bytes, rank: int) -> bytes:
    """What reader `rank` shows (in its hello subscription) to be admitted to queue `queue_id`."""
    return hmac.new(admit_key, b"rayfree/admit/" + queue_id + str(rank).encode(), hashlib.sha256).hexdigest()[:32] \
        .encode()


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(8, "little") + b"\0\0\0\0"


def _header(seq: int, lengths: list[int]) -> bytes:
    return _HEAD.pack(MAGIC, seq, len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths)


class Sealer:
    """The writer's side: seals each message once; not thread-safe (one per publisher, used by its writer)."""

    def __init__(self, key: bytes, queue_id: bytes) -> None:
        self._alg = algorithms.AES(key)
        self._aead = AESGCM(key)
        self._qid = queue_id
        self.seq = 0
        self._spare: dict[int, list[bytearray]] = {}

    def seal(self, frames: list) -> list:
        """[header, ciphertext of each frame]; big ciphertexts are views of reused buffers (see `give_back`)."""
        seq = self.seq
        self.seq += 1
        if len(frames) == 1 and type(frames[0]) is bytes and len(frames[0]) < _ONE_SHOT:  # the step's message
            data = frames[0]
            head = _HEAD_ONE1.pack(MAGIC_ONE, seq, 1, len(data))
            return [head + self._aead.encrypt(_nonce(seq), data, self._qid + head)]
        views = [f if isinstance(f, memoryview) else memoryview(f) for f in frames]
        lengths = [v.nbytes for v in views]
        head = _header(seq, lengths)
        if sum(lengths) < _ONE_SHOT:  # one frame: header, ciphertext, tag
            head = MAGIC_ONE + head[4:]
            return [head + self._aead.encrypt(_nonce(seq), b"".join(views), self._qid + head)]
        enc = Cipher(self._alg, modes.GCM(_nonce(seq))).encryptor()
        enc.authenticate_additional_data(self._qid + head)
        out: list = [None]
        for v, n in zip(views, lengths):
            buf = self._buffer(n)
            k = enc.update_into(v.cast("B") if v.format != "B" or v.ndim != 1 else v, buf)
            assert k == n
            out.append(memoryview(buf)[:n])
        enc.finalize()
        out[0] = head + enc.tag
        return out

    def _buffer(self, n: int) -> bytearray:
        spare = self._spare.get(n + 15)
        return spare.pop() if spare else bytearray(n + 15)

    def give_back(self, sealed: list) -> None:
        """Sealed frames ZeroMQ has finished with: their buffers serve the next message of that size."""
        for v in sealed[1:]:
            if isinstance(v, memoryview) and v.nbytes >= _SMALL:
                base = v.obj
                lst = self._spare.setdefault(len(base), [])
                if len(lst) < 4:
                    lst.append(base)


class Opener:
    """A reader's side: verifies and decrypts into this reader's own buffers, in order, or refuses."""

    def __init__(self, key: bytes, queue_id: bytes, pool_limit: int = 128 << 20) -> None:
        self._alg = algorithms.AES(key)
        self._aead = AESGCM(key)
        self._qid = queue_id
        self.expect = 0
        self.pool = BufferPool(pool_limit)

    def open(self, parts: list) -> list:
        """The message's plaintext frames; BadFrame (nothing else is touched) when it is not genuine."""
        if not parts:
            raise BadFrame("an empty message")
        first = parts[0]
        magic = bytes(first[:4])
        if magic == MAGIC_ONE and len(first) >= _HEAD.size + _TAG:
            return self._open_one(first, len(parts))
        if len(first) < _HEAD.size + _TAG or magic != MAGIC:
            raise BadFrame("not a sealed rayfree message (wrong magic or length)")
        head = bytes(first)
        _, seq, n = _HEAD.unpack_from(head)
        if n != len(parts) - 1 or len(head) != _HEAD.size + 8 * n + _TAG:
            raise BadFrame(f"a sealed message with {len(parts) - 1} frame(s) whose header says {n}")
        lengths = struct.unpack_from(f"<{n}Q", head, _HEAD.size)
        if any(memoryview(p).nbytes != ln for p, ln in zip(parts[1:], lengths)):
            raise BadFrame("a sealed message whose frame lengths do not match its header (truncated?)")
        self._check_order(seq)
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
        self.expect = seq + 1
        return out

    def _check_order(self, seq: int) -> None:
        if seq != self.expect:
            raise BadFrame(f"a sealed message out of order: sequence {seq}, expected {self.expect} "
                           f"(replayed, reordered, or lost)")

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
        self._check_order(seq)
        mv = msg if isinstance(msg, memoryview) else memoryview(msg)
        try:
            pt = self._aead.decrypt(_nonce(seq), mv[hlen:], self._qid + bytes(mv[:hlen]))
        except InvalidTag:
            raise _forged() from None
        self.expect = seq + 1
        if n == 1:
            return [pt]  # one frame: a pickle stream (or a control or raw message), read, never written to
        view = memoryview(bytearray(pt))  # writable, like every out-of-band buffer a reader gets
        out, off = [], 0
        for ln in lengths:
            out.append(view[off: off + ln])
            off += ln
        return out


def _forged() -> BadFrame:
    return BadFrame("a sealed message that fails authentication (forged, tampered, or from another queue or cluster)")
