"""Sealing a queue's TCP messages once, for every subscriber: AES-256-GCM keyed from the cluster secret.

CURVE (what ZeroMQ offers) encrypts a publisher's message once per
subscriber, in ZeroMQ's single I/O thread: 4 readers cost 4 encryptions.
Instead the writer seals each message once (AES-GCM through `cryptography`,
which uses the CPU's AES instructions) and publishes the sealed frames to
every admitted subscriber; each reader opens it into its own buffers
(docs/benchmarks.md has the figures).

Wire format of a sealed message: frame 0 is the header
`MAGIC | u64 seq | u32 n | u64 length[n] | 16-byte tag`, frames 1..n the
ciphertexts of the message's frames, one GCM stream over all of them. A
message under 64 KiB in all travels as one frame: the header (with
MAGIC_ONE, no tag), then the ciphertext of its frames joined, then the tag
(AES-GCM's own output, so neither side reassembles it).

A message of SEG_MIN bytes or more travels as several ZeroMQ messages,
segments of at most SEG_SIZE (1 MiB), each sealed on its own
(AESGCM.encrypt_into, one sequence number each) and handed to ZeroMQ as soon
as it is sealed, so sealing, sending and opening overlap where cores allow
(docs/benchmarks.md has what that buys on this project's machine).

The head segment `MAGIC_SEG | u64 seq | u32 segments | u32 n | u32 segment size | u64
length[n]` says how the message's frames are laid out (each at a 64-byte
aligned offset of one buffer; `plan`); the others are `MAGIC_CONT | u64 seq
| u32 index`, then ciphertext and tag. A head that arrives while a message
is unfinished means its writer gave up on that one mid-way (a timeout): the
unfinished one is dropped, counted, and never handed on.

The key is per queue (HMAC of the cluster's data key and the queue id), the
nonce is the sequence number, and the header is authenticated data. A reader
accepts exactly the next sequence number: a message forged, tampered,
truncated, replayed, reordered, or from another queue or cluster fails the
tag or the order check, is counted and skipped, and is never unpickled
(nothing is handed on before the tag is verified).

Subscribers are admitted only with a token derived from the secret, the
queue id and their rank (zmq/sender.py, zmq/receiver.py), once per rank: a peer
without the secret gets no messages, so it cannot stall the writer either.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["Sealer", "queue_key", "admission_token", "plan", "MAGIC", "SEG_MIN"]

MAGIC = b"RFA1"
MAGIC_ONE = b"RFA2"
MAGIC_SEG = b"RFA3"
MAGIC_CONT = b"RFA4"
_SEG_HEAD = struct.Struct("<4sQIII")
_SEG_CONT = struct.Struct("<4sQI")
#: Messages of at least this many bytes are sent as segments (see the module's docstring).
SEG_MIN = 1 << 20
#: Bytes per segment. Measured (4 and 32 MiB, 1 and 4 readers): 256 KiB, 1 MiB and 4 MiB segments are alike
#: at 4 MiB; at 32 MiB 1 MiB ones are the fastest (13.0 ms, vs 15.8 and 14.5; one 32 MiB message: 30 ms).
SEG_SIZE = 1 << 20
_SEG_BOUND = 1 << 30  # what a reader accepts in a head (a sanity bound)
_ALIGN = 64
_MAX_FRAMES = 1 << 16
_HEAD = struct.Struct("<4sQI")
_HEAD_ONE1 = struct.Struct("<4sQIQ")  # a one-frame message of one frame: the commonest, packed in one call
_TAG = 16
_SMALL = 1 << 16  # frames below this get a plain bytearray; bigger ones a warm pooled buffer
# A message smaller than this in all is sealed in one call over its joined frames (setting up a streaming
# cipher costs several times more); the ciphertext and tag are the same either way (GCM over the concatenation).
_ONE_SHOT = 1 << 16


def queue_key(data_key: bytes, queue_id: bytes) -> bytes:
    """The queue's own AES-256 key: nonces (sequence numbers) then never repeat under one key."""
    return hmac.new(data_key, b"rayfree/queue-key/" + queue_id, hashlib.sha256).digest()


def admission_token(admit_key: bytes, queue_id: bytes, rank: int) -> bytes:
    """What reader `rank` shows (in its hello subscription) to be admitted to queue `queue_id`."""
    return (
        hmac.new(admit_key, b"rayfree/admit/" + queue_id + str(rank).encode(), hashlib.sha256).hexdigest()[:32].encode()
    )


_nonce = struct.Struct("<Q4x").pack  # the 12-byte GCM nonce of sequence number `seq`


def plan(lengths: list[int] | tuple[int, ...], seg: int) -> tuple[list[int], int, list[tuple[int, int, int, int]]]:
    """How a segmented message's frames lie in one buffer and which segment carries which bytes.

    Returns (offset of each frame, buffer size, segments); frame i starts at a 64-byte aligned offset, and a
    segment is (start, end, first frame, last frame): either a piece of one frame bigger than `seg`, or a run
    of whole smaller frames (with the padding between them) of at most `seg` bytes. Writer and reader both
    derive it from the head's lengths, so it never travels.
    """
    offs, pos = [], 0
    for n in lengths:
        offs.append(pos)
        pos = (pos + n + _ALIGN - 1) & ~(_ALIGN - 1)
    segs: list[tuple[int, int, int, int]] = []
    run: list[int] | None = None
    for i, n in enumerate(lengths):
        o = offs[i]
        if n > seg:
            if run is not None:
                segs.append((run[0], run[1], run[2], run[3]))
                run = None
            segs.extend((o + p, o + min(n, p + seg), i, i) for p in range(0, n, seg))
        elif run is not None and o + n - run[0] <= seg:
            run[1], run[3] = o + n, i
        else:
            if run is not None:
                segs.append((run[0], run[1], run[2], run[3]))
            run = [o, o + n, i, i]
    if run is not None:
        segs.append((run[0], run[1], run[2], run[3]))
    return offs, pos, segs


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

    def segments(self, frames: list) -> tuple[bytearray, Iterator[memoryview]] | None:
        """A message of SEG_MIN bytes or more as (its buffer, an iterator of sealed segments); None for a smaller
        one (use `seal`). Each segment is sealed when the iterator reaches it, so the caller sends one while the
        next is not sealed yet; the buffer stays the caller's until ZeroMQ is done with every segment
        (then `give_back([None, buffer])`). A segment not sent must be given back with `self.seq -= 1`."""
        views = [f if isinstance(f, memoryview) else memoryview(f) for f in frames]
        lengths = [v.nbytes for v in views]
        total = sum(lengths)
        if total < SEG_MIN or len(views) > _MAX_FRAMES:
            return None
        seg = SEG_SIZE
        offs, _, segs = plan(lengths, seg)
        head_len = _SEG_HEAD.size + 8 * len(lengths)
        size = head_len + _SEG_CONT.size * (len(segs) - 1) + sum(e - b for b, e, _, _ in segs) + _TAG * len(segs)
        buf = self._buffer(size)
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        return buf, self._seal_segments(buf, flat, lengths, offs, segs, seg, head_len)

    def _seal_segments(
        self,
        buf: bytearray,
        flat: list[memoryview],
        lengths: list[int],
        offs: list[int],
        segs: list[tuple[int, int, int, int]],
        seg: int,
        head_len: int,
    ) -> Iterator[memoryview]:
        out = memoryview(buf)
        aead, qid = self._aead, self._qid
        pos = 0
        for k, (b, e, i0, i1) in enumerate(segs):
            seq = self.seq
            self.seq += 1
            if k == 0:
                hl = head_len
                _SEG_HEAD.pack_into(buf, pos, MAGIC_SEG, seq, len(segs), len(lengths), seg)
                struct.pack_into(f"<{len(lengths)}Q", buf, pos + _SEG_HEAD.size, *lengths)
            else:
                hl = _SEG_CONT.size
                _SEG_CONT.pack_into(buf, pos, MAGIC_CONT, seq, k)
            if i0 == i1:  # a piece of one frame, or one whole frame: straight from the caller's memory
                data = flat[i0][b - offs[i0] : e - offs[i0]]
            else:  # a run of small frames: gathered, with zeroed padding between them
                data = bytearray(e - b)
                for i in range(i0, i1 + 1):
                    data[offs[i] - b : offs[i] - b + lengths[i]] = flat[i]
            end = pos + hl + (e - b) + _TAG
            aead.encrypt_into(_nonce(seq), data, qid + bytes(out[pos : pos + hl]), out[pos + hl : end])
            yield out[pos:end]
            pos = end

    def _buffer(self, n: int) -> bytearray:
        spare = self._spare.get(n + 15)
        return spare.pop() if spare else bytearray(n + 15)

    def give_back(self, sealed: list) -> None:
        """Sealed frames (or a segmented message's buffer) ZeroMQ has finished with: their buffers serve the
        next message of that size."""
        for v in sealed[1:]:
            base = v if type(v) is bytearray else v.obj if isinstance(v, memoryview) and v.nbytes >= _SMALL else None
            if base is not None:
                lst = self._spare.setdefault(len(base), [])
                if len(lst) < 4:
                    lst.append(base)
