"""rayfree's bottom layer: move Python objects (with tensors) from one writer to many readers.

Same node: a shared-memory ring. Other nodes: ZeroMQ pub/sub over TCP. Knows
nothing of ranks, groups or torch.distributed.
"""

from .errors import (BadFrame, HandleError, MessageTooLarge, QueueClosed, QueueShutdown, QueueTimeout,
                     SegmentNotFound, ShmSpaceError, TransportError)
from .handle import Handle
from .message_queue import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, MessageQueue
from .net import get_ip, get_open_port
from .shm_ring import ShmRingBuffer

__all__ = [
    "MessageQueue", "Handle", "ShmRingBuffer", "get_ip", "get_open_port",
    "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS",
    "TransportError", "QueueTimeout", "QueueShutdown", "QueueClosed", "MessageTooLarge",
    "HandleError", "ShmSpaceError", "SegmentNotFound", "BadFrame",
]
