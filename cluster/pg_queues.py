"""vLLM's MessageQueue constructors over a torch.distributed process group.

`create_from_process_group(pg, ...)` and `create_from_process_group_single_reader(pg, ...)`
are plain functions here, in the cluster layer (the transport knows nothing of
process groups). vLLM spells them as static methods of the queue's class:
`MessageQueue` below is the transport's queue with them, and it is what
`from rayfree import MessageQueue` gives, so an engine switches by changing an
import. Nothing is attached to the transport's own class.
"""

from __future__ import annotations

import inspect
from typing import Any

from rayfree import transport
from rayfree.transport import Handle

__all__ = ["create_from_process_group", "create_from_process_group_single_reader", "MessageQueue"]


def _group_of(pg: Any):
    """A rayfree Group over torch process group `pg` (this process must be in it)."""
    import torch.distributed as dist

    from rayfree.transport import get_ip

    from . import parallel_state as ps
    from .group import Group

    if pg is None:
        pg = dist.group.WORLD
    ranks = list(range(dist.get_world_size())) if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
    ours = ps._WORLD is not None  # joined through rayfree: its master address and timeouts
    return Group(
        ranks,
        dist.get_rank(),
        pg,
        name="process-group",
        advertise_ip=get_ip(peer=ps._MASTER) if ours else get_ip(),
        force_remote=ps._FORCE_REMOTE if ours else None,
        queue_timeout_s=ps._TIMEOUT_S,
    )


def create_from_process_group(
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    writer_rank: int = 0,
    external_writer_handle: Handle | bytes | None = None,
    blocking: bool = True,
) -> transport.MessageQueue:
    """One writer (group rank `writer_rank`) to every other rank of `pg`: shared memory on the writer's node,
    TCP elsewhere. With `external_writer_handle` the writer is outside the group and every rank reads."""
    g = _group_of(pg)
    return g.create_mq_broadcaster(
        writer_rank=writer_rank,
        external_writer_handle=external_writer_handle,
        blocking=blocking,
        max_chunk_bytes=max_chunk_bytes,
        max_chunks=max_chunks,
    )


def create_from_process_group_single_reader(
    pg: Any, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0, blocking: bool = False
) -> tuple[transport.MessageQueue, list[Handle]]:
    """Each rank of `pg` writes a one-reader queue toward global rank `reader_rank`; that rank gets every
    handle (in group order), the others an empty list."""
    g = _group_of(pg)
    if reader_rank not in g.ranks:
        raise ValueError(f"reader_rank={reader_rank} is not in the process group (ranks {g.ranks})")
    return g.create_single_reader_mq_broadcasters(
        reader_rank_in_group=g.ranks.index(reader_rank),
        blocking=blocking,
        max_chunk_bytes=max_chunk_bytes,
        max_chunks=max_chunks,
    )


class MessageQueue(transport.MessageQueue):
    __doc__ = inspect.cleandoc(transport.MessageQueue.__doc__ or "") + (
        "\n\nWith vLLM's two constructors over a torch.distributed process group as static methods "
        "(`create_from_process_group`, `create_from_process_group_single_reader`)."
    )

    create_from_process_group = staticmethod(create_from_process_group)
    create_from_process_group_single_reader = staticmethod(create_from_process_group_single_reader)
