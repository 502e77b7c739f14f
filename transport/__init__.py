"""rayfree's bottom layer: move Python objects (with tensors) from one writer to many readers.

Same node: a shared-memory ring. Other nodes: ZeroMQ pub/sub over TCP. Knows
nothing of ranks, groups or torch.distributed. Four rooms: `shm/` (the segment,
the ring's protocol, its slots, waiting, bulk copies), `zmq/` (sockets and
their one error translation, the socket channel, lingering publishers),
`secure/` (the secret policy, the ZAP handler, sealing), `queue/` (the
MessageQueue built on them); at the root, the channel face, errors, serde and
addresses.
"""

if __name__ != "rayfree.transport":  # the repository's folder imported as a top-level package: two copies of rayfree
    raise ImportError(
        f"import rayfree.transport, not {__name__}: this folder installs as rayfree.transport "
        f"(pip install -e . puts it there)"
    )


from .errors import (
    BadFrame,
    HandleError,
    MessageTooLarge,
    OutOfSequence,
    QueueBroken,
    QueueClosed,
    QueueShutdown,
    QueueTimeout,
    SegmentNotFound,
    ShmSpaceError,
    TransportError,
)
from .net import get_ip, get_open_port
from .queue.handle import Handle
from .queue.message_queue import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, MessageQueue
from .shm.segment import ShmRingBuffer
from .zmq.sockets import SocketError

__all__ = [
    "MessageQueue",
    "Handle",
    "ShmRingBuffer",
    "get_ip",
    "get_open_port",
    "SocketError",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_MAX_CHUNKS",
    "TransportError",
    "QueueTimeout",
    "QueueShutdown",
    "QueueClosed",
    "QueueBroken",
    "OutOfSequence",
    "MessageTooLarge",
    "HandleError",
    "ShmSpaceError",
    "SegmentNotFound",
    "BadFrame",
]
