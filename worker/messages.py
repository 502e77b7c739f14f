"""What crosses a worker's status pipe (msgspec, never pickle) and the shape of replies."""

from __future__ import annotations

import traceback

import msgspec

__all__ = [
    "Ready",
    "StartupFailed",
    "Fatal",
    "PipeMsg",
    "encode",
    "decode",
    "RemoteError",
    "Boxed",
    "is_special",
    "describe",
]


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """A worker finished start-up; here is how to read its replies."""

    rank: int
    response_handle: bytes
    #: on the leader node's first worker in multi-node runs: every rank's reply-queue handle
    peer_response_handles: list[bytes] = []
    #: on a follower node's first worker (broadcast by relay): the leader's queue handle, and the endpoint this
    #: node's relay subscribes to (node 0's, or its parent node's relay)
    upstream_handle: bytes = b""
    upstream_endpoint: str = ""


class StartupFailed(msgspec.Struct, tag="failed", frozen=True):
    """A worker could not start; the parent raises this as an error naming the rank."""

    rank: int
    error_type: str
    message: str
    traceback: str


class Fatal(msgspec.Struct, tag="fatal", frozen=True):
    """A collective step raised: the worker leaves (its peers may be stuck in a collective with it), and says why
    first, so the executor fails at once naming the rank, even when that rank does not reply."""

    rank: int
    method: str
    error_type: str
    message: str
    traceback: str


PipeMsg = Ready | StartupFailed | Fatal
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(PipeMsg)


def encode(msg: PipeMsg) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes) -> PipeMsg:
    return _dec.decode(data)


class RemoteError(msgspec.Struct, frozen=True):
    """An exception raised in a worker: type, message and the worker's formatted traceback.

    A reply is the method's return value itself (no status envelope: the
    engine's step pays for nothing it does not use), or a RemoteError when the
    method raised.
    """

    rank: int
    error_type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RemoteError:
        """What can be told of `e`, even when its own __str__ (or the traceback's) raises."""
        error_type, message = describe(e)
        try:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        except Exception as te:  # noqa: BLE001 - a broken exception must not break the report
            tb = f"(its traceback could not be formatted: {type(te).__name__})"
        return cls(rank, error_type, message, tb)


def describe(e: BaseException) -> tuple[str, str]:
    """(type name, message) of `e`; a message that cannot be made says so instead of raising."""
    try:
        message = str(e)
    except Exception as se:  # noqa: BLE001
        message = f"<str() of this {type(e).__name__} raised {type(se).__name__}>"
    return type(e).__name__, message


class Boxed(msgspec.Struct, frozen=True):
    """A return value that is itself a RemoteError or a Boxed, so it is not taken for a failure."""

    value: object


def is_special(value: object) -> bool:
    """The reader's one check: is this reply a failure or a wrapped value?

    Only a RemoteError or a Boxed result is wrapped."""
    t = type(value)
    return t is RemoteError or t is Boxed
