"""Where a message's frames sit inside its ring slot.

Head chunk::

    0   u8  kind (0 data, 1 overflow: frames follow on the overflow socket, 2 wrap,
            3 raw bytes: one frame that is the message itself, no pickle)
    4   u32 span (chunks the message occupies)
    8   u32 frame count n
    16  u64 length[n]
    ..  frame 0 (the pickle stream), then frames 1..n-1 (out-of-band buffers),
        each buffer starting on a 64-byte boundary so it can be viewed in place
        as a tensor of any dtype.
"""

from __future__ import annotations

import struct

from .errors import BadFrame

FRAME_ALIGN = 64
_HEAD = struct.Struct("<BxxxII")      # kind, span, nframes (12 bytes, lengths start at 16)
_ONE = struct.Struct("<BxxxIIxxxxQ")  # the same head with a single length: 24 bytes
_LEN = struct.Struct("<Q")
ONE_FRAME_OFFSET = _ONE.size


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of each frame from the slot start, and the slot's total size."""
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


def write_one(buf, base: int, span: int, data) -> None:
    """Fast path: a message that is one pickle stream."""
    n = len(data)
    _ONE.pack_into(buf, base, 0, span, 1, n)
    buf[base + 24: base + 24 + n] = data


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
    _, _, n, length = _ONE.unpack_from(buf, base)
    return length if n == 1 else -1
