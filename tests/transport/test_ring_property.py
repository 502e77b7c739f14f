"""Property test of the ring's state machine: no chunk is overwritten before every reader
released it, and every reader sees every message exactly once, in order."""

from __future__ import annotations

import pickle
import secrets
import struct

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rayfree.transport.shm.ring import RingReader, RingWriter
from rayfree.transport.shm.segment import ShmRingBuffer
from rayfree.transport.shm.slots import KIND_DATA, write_head

_STAMP = struct.Struct("<Q")
_STAMP_AT = 64  # past the slot header


class RingMachine(RuleBasedStateMachine):
    @initialize(n_reader=st.integers(1, 3), n_chunks=st.integers(2, 6))
    def setup(self, n_reader: int, n_chunks: int) -> None:
        self.ring = ShmRingBuffer.create(n_reader, 4096, n_chunks, secrets.token_bytes(16))
        self.ring.unlink()
        self.w = RingWriter(self.ring)
        self.readers = [RingReader(self.ring, r, pickle.loads) for r in range(n_reader)]
        self.seq = 0
        # per reader: messages published but not yet polled (FIFO), and polled but not released
        self.pending: list[list[tuple[int, int, int]]] = [[] for _ in range(n_reader)]
        self.held: list[list[tuple[int, int, int]]] = [[] for _ in range(n_reader)]
        self.last_seen = [-1] * n_reader

    def teardown(self) -> None:
        if hasattr(self, "ring"):
            self.ring.close()

    def _busy(self, c: int) -> bool:
        """The model's view: some reader has not released chunk c."""
        for r in range(len(self.readers)):
            for _seq, start, span in self.pending[r] + self.held[r]:
                if start <= c < start + span:
                    return True
        return False

    def _stamp(self, c: int) -> int:
        return _STAMP.unpack_from(self.ring.buf, self.ring.chunk_offset(c) + _STAMP_AT)[0]

    @rule(span=st.integers(1, 6))
    def write(self, span: int) -> None:
        n = self.ring.n_chunks
        span = min(span, n)
        old = self.w.idx
        wraps = old + span > n
        start = self.w.try_reserve(span)
        wrapped = wraps and self.w.idx == 0
        if wrapped:
            for r in range(len(self.readers)):
                self.pending[r].append((-1, old, 1))  # the WRAP marker it published
        if start is None:
            needed = [old] if wraps and not wrapped else range(0 if wraps else old, (0 if wraps else old) + span)
            assert any(self._busy(c) for c in needed), "writer refused a free run"
            return
        for c in range(start, start + span):
            assert not self._busy(c), f"writer reserved chunk {c} that a reader still holds"
        self.seq += 1
        for c in range(start, start + span):
            _STAMP.pack_into(self.ring.buf, self.ring.chunk_offset(c) + _STAMP_AT, self.seq)
        write_head(self.ring.buf, self.ring.chunk_offset(start), KIND_DATA, span, [0])
        self.w.commit(start, span)
        for r in range(len(self.readers)):
            self.pending[r].append((self.seq, start, span))

    @rule(r=st.integers(0, 2))
    def read(self, r: int) -> None:
        r %= len(self.readers)
        got = self.readers[r].poll()
        # polling consumes WRAP markers silently
        while self.pending[r] and self.pending[r][0][0] == -1:
            self.pending[r].pop(0)
        if not self.pending[r]:
            assert got is None, f"reader {r} read {got} but nothing was published for it"
            return
        seq, start, span = self.pending[r].pop(0)
        assert got == (start, KIND_DATA, span), f"reader {r} expected message {seq} at {start}, got {got}"
        assert seq > self.last_seen[r], "a reader saw a message twice or out of order"
        self.last_seen[r] = seq
        for c in range(start, start + span):
            assert self._stamp(c) == seq, f"chunk {c} was overwritten before reader {r} read it"
        self.held[r].append((seq, start, span))

    @precondition(lambda self: any(self.held))
    @rule(r=st.integers(0, 2), which=st.integers(0, 10))
    def release(self, r: int, which: int) -> None:
        r %= len(self.readers)
        if not self.held[r]:
            return
        seq, start, span = self.held[r].pop(which % len(self.held[r]))
        for c in range(start, start + span):
            assert self._stamp(c) == seq, f"chunk {c} was overwritten while reader {r} still held it"
        self.readers[r].release(start, span)

    @invariant()
    def flags_agree_with_model(self) -> None:
        if not hasattr(self, "ring"):
            return
        for c in range(self.ring.n_chunks):
            if self._busy(c):
                assert not self.w.chunk_free(c), f"chunk {c} is held but the ring calls it free"


RingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestRing = RingMachine.TestCase
