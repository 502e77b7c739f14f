"""What crosses the ready pipe (msgspec, never pickle) and the shape of replies."""

from __future__ import annotations

import msgspec

__all__ = ["Ready", "StartupFailed", "PipeMsg", "encode", "decode", "SUCCESS", "FAILURE", "RemoteError"]

#: Reply statuses: a reply is (status, result); a FAILURE's result is a RemoteError.
SUCCESS = 0
FAILURE = 1


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """A worker finished start-up; here is how to read its replies."""

    rank: int
    response_handle: bytes
    #: on the leader node's first worker in multi-node runs: every rank's reply-queue handle
    peer_response_handles: list[bytes] = []


class StartupFailed(msgspec.Struct, tag="failed", frozen=True):
    """A worker could not start; the parent raises this as an error naming the rank."""

    rank: int
    error_type: str
    message: str
    traceback: str


PipeMsg = Ready | StartupFailed
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(PipeMsg)


def encode(msg: PipeMsg) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes) -> PipeMsg:
    return _dec.decode(data)


class RemoteError(msgspec.Struct, frozen=True):
    """An exception raised in a worker: type, message and the worker's formatted traceback."""

    rank: int
    error_type: str
    message: str
    traceback: str
