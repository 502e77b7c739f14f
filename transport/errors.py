"""The transport's exceptions, one type per thing a caller may want to handle.

Each inherits the builtin a caller would already catch (TimeoutError,
ValueError, OSError), so code written against vLLM's queue keeps working.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error raised by rayfree's transport layer."""


class QueueTimeout(TransportError, TimeoutError):
    """A blocking call ran past its timeout; the message says who we waited for."""


class QueueShutdown(TransportError, RuntimeError):
    """`shutdown()` was called on this queue while (or before) a call blocked on it."""


class QueueClosed(TransportError, EOFError):
    """The writer closed the queue: no more messages will arrive."""


class QueueBroken(TransportError, ConnectionError):
    """A remote reader's connection to the writer dropped: what was sent meanwhile is lost, and the writer does
    not take the reconnected reader back, so the queue cannot go on."""


class OutOfSequence(QueueBroken):
    """A stream's message arrived with another sequence number than the next one: one was lost, repeated or
    reordered. The stream cannot be trusted from here on; the message names it and both numbers."""

    def __init__(self, message: str, seq: int = -1, expected: int = -1) -> None:
        super().__init__(message)
        self.seq = seq
        self.expected = expected


class MessageTooLarge(TransportError, ValueError):
    """The message exceeds the queue's `max_message_bytes`; nothing was sent."""


class HandleError(TransportError, ValueError):
    """A handle is truncated, foreign, from another version, or names another queue."""


class ShmSpaceError(TransportError, OSError):
    """/dev/shm has less free space than the ring needs."""


class SegmentNotFound(TransportError, FileNotFoundError):
    """The handle's shared-memory segment cannot be opened from this process.

    Either the reader is on another node (attach as a remote reader) or the
    writer already unlinked it (every local reader must attach before the
    writer's `wait_until_ready()` completes).
    """


class BadFrame(TransportError, ValueError):
    """A received message is malformed (wrong lengths, truncated, garbage)."""
