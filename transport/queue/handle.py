"""`Handle`: everything a reader needs to attach to a queue, as a msgspec Struct.

It crosses process and node boundaries before peers are authenticated, so it
is msgpack, never pickle, signed with the cluster secret when there is one
(signing.seal), and `from_bytes` checks it thoroughly.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from ..errors import HandleError
from ..secure import signing

__all__ = ["Handle", "HANDLE_VERSION"]

HANDLE_VERSION = 1
_MAGIC = b"RFQH"


class Handle(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach one MessageQueue (see `MessageQueue.export_handle`)."""

    version: int
    queue_id: str
    n_reader: int
    local_reader_ranks: list[int]
    shm_name: str | None
    shm_size: int
    max_chunk_bytes: int
    max_chunks: int
    ipc_dir: str | None
    local_endpoint: str | None
    remote_endpoint: str | None
    max_message_bytes: int | None
    writer_pid: int

    @classmethod
    def for_writer(
        cls,
        queue_id: bytes,
        n_reader: int,
        local_reader_ranks: list[int],
        ring: dict[str, Any] | None,
        max_chunk_bytes: int,
        max_chunks: int,
        remote_endpoint: str | None,
        max_message_bytes: int | None = None,
    ) -> Handle:
        """The handle of a queue this process writes: `ring` is its ring's names (`ShmSender.names`), or None
        for a queue without one (every reader remote)."""
        names = ring or {"shm_name": None, "shm_size": 0, "ipc_dir": None, "local_endpoint": None}
        return cls(
            version=HANDLE_VERSION,
            queue_id=queue_id.hex(),
            n_reader=n_reader,
            local_reader_ranks=local_reader_ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            remote_endpoint=remote_endpoint,
            max_message_bytes=max_message_bytes,
            writer_pid=os.getpid(),
            **names,
        )

    @property
    def n_local_reader(self) -> int:
        return len(self.local_reader_ranks)

    @property
    def remote_subscribe_addr(self) -> str | None:
        """vLLM's name for the TCP endpoint remote readers subscribe to."""
        return self.remote_endpoint

    @property
    def local_subscribe_addr(self) -> str | None:
        """vLLM's name for the ipc endpoint local readers subscribe to (overflow, READY, CLOSE)."""
        return self.local_endpoint

    def to_bytes(self) -> bytes:
        return signing.seal(_MAGIC + msgspec.msgpack.encode(self))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Handle:
        return cls.from_signed(data)[0]

    @classmethod
    def from_signed(cls, data: bytes | bytearray | memoryview) -> tuple[Handle, bytes | None]:
        """The handle and its signature's nonce (None when unsigned), for `signing.check_fresh`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise HandleError(f"a handle is bytes from Handle.to_bytes(), got {type(data).__name__}")
        data, nonce = signing.unseal(bytes(data))
        return cls._parse(data), nonce

    @classmethod
    def _parse(cls, data: bytes) -> Handle:
        if len(data) < len(_MAGIC):
            raise HandleError(f"handle is truncated: {len(data)} bytes")
        if data[: len(_MAGIC)] != _MAGIC:
            raise HandleError(
                "these bytes are not a rayfree queue handle (wrong magic): pass exactly what Handle.to_bytes() returned"
            )
        try:
            h = msgspec.msgpack.decode(data[len(_MAGIC) :], type=cls)
        except msgspec.ValidationError as e:
            raise HandleError(f"handle fields are invalid: {e}") from None
        except msgspec.DecodeError as e:
            raise HandleError(f"handle is truncated or corrupt: {e}") from None
        h.validate()
        return h

    def validate(self) -> None:
        """Raise HandleError if the fields contradict each other."""
        if self.version != HANDLE_VERSION:
            raise HandleError(
                f"handle has version {self.version}, this rayfree reads {HANDLE_VERSION}: "
                f"run the same rayfree version on every node"
            )
        if self.n_reader < 1:
            raise HandleError(f"handle says n_reader={self.n_reader}; a queue has at least one reader")
        ranks = self.local_reader_ranks
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.n_reader for r in ranks):
            raise HandleError(f"handle's local_reader_ranks {ranks} must be distinct ranks in 0..{self.n_reader - 1}")
        if ranks and not (self.shm_name and self.local_endpoint and self.ipc_dir):
            raise HandleError("handle has local readers but no shared-memory segment or overflow endpoint")
        if len(ranks) < self.n_reader and not self.remote_endpoint:
            raise HandleError("handle has remote readers but no remote endpoint")
