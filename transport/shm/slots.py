"""The slot layout: where a message's kind, span and frames sit in its ring chunks. The only module that knows it.

Head chunk of every message::

    0   u8  kind   KIND_DATA    frames: a pickle stream and its out-of-band buffers
                   KIND_OVERFLOW  nothing here: the frames travel on the overflow socket
                   KIND_WRAP    nothing here: the next message starts at chunk 0
    4   u32 span   chunks the message occupies (consecutive, never wrapping)
    8   u32 frame count n
    16  u64 length[n]
    ..  frame 0 (the pickle stream), then frames 1..n-1 (out-of-band buffers),
        each buffer starting on a 64-byte boundary so it can be viewed in place
        as a tensor of any dtype.

A one-frame message (the common case: a small pickle, or serde's raw bytes) has its
frame at ONE_FRAME_OFFSET (24): 16 bytes of head and one length.
"""

from __future__ import annotations

import struct

from ..errors import BadFrame

__all__ = [
    "KIND_DATA",
    "KIND_OVERFLOW",
    "KIND_WRAP",
    "KINDS",
    "SLOT",
    "ONE",
    "ONE_FRAME_OFFSET",
    "FRAME_ALIGN",
    "layout",
    "write_head",
    "write_one",
    "read_layout",
    "read_one_length",
]

KIND_DATA = 0
KIND_OVERFLOW = 1
KIND_WRAP = 2
#: kinds a reader hands to its caller (WRAP is the ring's own)
KINDS = (KIND_DATA, KIND_OVERFLOW)

FRAME_ALIGN = 64
SLOT = struct.Struct("<BxxxI")  # kind, span: what the ring protocol reads of every head chunk
_HEAD = struct.Struct("<BxxxII")  # kind, span, nframes (12 bytes, lengths start at 16)
ONE = struct.Struct("<BxxxIIxxxxQ")  # the same head with a single length: 24 bytes
ONE_FRAME_OFFSET = ONE.size


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of each frame from the slot start, and the slot's total size."""
    if len(sizes) == 1:
        return [ONE_FRAME_OFFSET], ONE_FRAME_OFFSET + sizes[0]
    off = 16 + 8 * len(sizes)
    offsets = []
    for i, sz in enumerate(sizes):
        if i:
            off = (off + FRAME_ALIGN - 1) & -FRAME_ALIGN
        offsets.append(off)
        off += sz
    return offsets, off


def write_head(buf, base: int, kind: int, span: int, sizes: list[int]) -> None:
    _HEAD.pack_into(buf, base, kind, span, len(sizes))
    struct.pack_into(f"<{len(sizes)}Q", buf, base + 16, *sizes)


def write_one(buf, base: int, kind: int, span: int, data) -> None:
    """A message that is one frame (a pickle stream, or serde's raw bytes)."""
    n = len(data)
    ONE.pack_into(buf, base, kind, span, 1, n)
    buf[base + ONE_FRAME_OFFSET : base + ONE_FRAME_OFFSET + n] = data


def read_layout(buf, base: int, limit: int) -> tuple[list[int], list[int]]:
    """(offsets, lengths) of the frames of the slot at `base`, `limit` bytes long."""
    _, _, n = _HEAD.unpack_from(buf, base)
    if n < 1 or 16 + 8 * n > limit:
        raise BadFrame(f"corrupt slot: frame count {n} does not fit a {limit}-byte slot")
    lengths = list(struct.unpack_from(f"<{n}Q", buf, base + 16))
    offsets, total = layout(lengths)
    if total > limit:
        raise BadFrame(f"corrupt slot: frames need {total} bytes but the slot has {limit}")
    return offsets, lengths


def read_one_length(buf, base: int) -> int:
    """Length of frame 0 when the slot holds exactly one frame, else -1."""
    _, _, n, length = ONE.unpack_from(buf, base)
    return length if n == 1 else -1
