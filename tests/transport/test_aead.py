"""The sealed data path's message layouts (aead.py), in one process: every layout of frames comes back bit-exact,
in its own writable memory, and a segmented message's frames are 64-byte aligned."""

from __future__ import annotations

import ctypes
import os

import pytest

from rayfree.transport.secure.aead import SEG_MIN, SEG_SIZE, Sealer, plan
from rayfree.transport.secure.opener import Opener

KIB, MIB = 1 << 10, 1 << 20

LAYOUTS = {
    "one small frame": [100],
    "one frame just under SEG_MIN": [SEG_MIN - 1],
    "stream + tensor of exactly SEG_MIN": [300, SEG_MIN],
    "stream + 32 MiB tensor": [700, 32 * MIB],
    "frames of exactly SEG_SIZE": [SEG_SIZE, SEG_SIZE, SEG_SIZE],
    "one byte over a segment": [SEG_SIZE + 1, 5],
    "many small frames": [200] + [70 * KIB] * 40,
    "small and big interleaved": [64, 3 * MIB + 7, 5 * KIB, 0, 2 * MIB, 63, 65],
    "empty frames around a big one": [0, 0, 2 * MIB, 0],
}


def _frames(lengths: list[int]) -> list[memoryview]:
    return [
        memoryview(bytearray(os.urandom(n) if n < MIB else os.urandom(64) * (n // 64) + os.urandom(n % 64)))
        for n in lengths
    ]


def _send(sealer: Sealer, opener: Opener, frames: list) -> tuple[list, int]:
    """Seal and open one message the way the socket channel does; returns (frames, ZeroMQ messages it took)."""
    segmented = sealer.segments(frames)
    if segmented is None:
        return opener.open([memoryview(bytes(f)) for f in sealer.seal(frames)]), 1
    buf, segments = segmented
    out, count = None, 0
    for seg in segments:
        assert out is None, "the message was complete before its last segment"
        out = opener.open([memoryview(bytes(seg))])
        count += 1
    sealer.give_back([None, buf])
    return out, count


@pytest.mark.parametrize("lengths", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_every_layout_comes_back_bit_exact_and_writable(lengths: list[int]) -> None:
    key, qid = os.urandom(32), os.urandom(16)
    sealer, opener = Sealer(key, qid), Opener(key, qid)
    for _ in range(3):  # the second and third reuse the writer's and reader's buffers
        frames = _frames(lengths)
        out, messages = _send(sealer, opener, frames)
        assert [bytes(f) for f in out] == [bytes(f) for f in frames]
        segmented = sum(lengths) >= SEG_MIN
        assert messages == (len(plan(lengths, SEG_SIZE)[2]) if segmented else 1)
        for f in out:
            m = memoryview(f)
            if m.nbytes:
                assert not m.readonly or not segmented
            if segmented and m.nbytes:
                assert ctypes.addressof(ctypes.c_char.from_buffer(m)) % 64 == 0, "a frame is not 64-byte aligned"
    assert sealer.seq == opener.expect


@pytest.mark.parametrize("lengths", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_the_plan_carries_every_byte_once_in_segments_of_at_most_seg_size(lengths: list[int]) -> None:
    offs, size, segs = plan(lengths, SEG_SIZE)
    assert all(o % 64 == 0 for o in offs) and size >= (offs[-1] + lengths[-1])
    covered = []
    for b, e, i0, i1 in segs:
        assert 0 <= b <= e <= size and e - b <= SEG_SIZE
        assert offs[i0] <= b and e <= offs[i1] + lengths[i1]
        covered.append((b, e))
    covered.sort()
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), "segments overlap"
    for o, n in zip(offs, lengths):  # each frame's bytes lie inside the segments
        inside = sum(max(0, min(e, o + n) - max(b, o)) for b, e in covered)
        assert inside == n


def test_a_forged_head_is_refused_before_its_layout_is_used() -> None:
    """A head claiming a 1 TiB frame in 1-byte segments (a layout that would take the reader's memory): refused
    as forged by its tag, before any plan is made or any buffer taken."""
    import struct

    from rayfree.transport.errors import BadFrame
    from rayfree.transport.secure.aead import MAGIC_SEG

    opener = Opener(os.urandom(32), os.urandom(16))
    head = struct.pack("<4sQIIIQ", MAGIC_SEG, 0, 1 << 30, 1, 1, 1 << 40)
    with pytest.raises(BadFrame, match="fails authentication"):
        opener.open([memoryview(head + b"\0" + os.urandom(16))])
    assert opener.pool.misses == 0 and opener.expect == 0
