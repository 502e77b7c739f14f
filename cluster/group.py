"""`Group`: a set of ranks with a gloo process group, byte collectives, and the two queue builders.

Everything exchanged here is raw bytes carrying msgspec/msgpack structures
(queue handles, the same-node probe), sent as uint8 tensors. The rendezvous
that carries them is not authenticated, so msgspec, with its strict types,
is the only decoder that ever sees them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from rayfree import settings
from rayfree.transport import Handle, MessageQueue
from rayfree.transport.shm.segment import check_probe, create_probe, remove_probe

if TYPE_CHECKING:
    import torch

__all__ = ["Group", "GroupError", "GroupLeft", "FORCE_REMOTE_ENV"]

logger = logging.getLogger("rayfree.cluster")

#: Set to 1 to treat every other rank as remote (no shared memory between ranks).
FORCE_REMOTE_ENV = "RAYFREE_FORCE_REMOTE"


class GroupError(RuntimeError):
    """A group operation failed; the message says which rank and what to check."""


class GroupLeft(GroupError):
    """This rank no longer belongs to the group it used: a peer of it went away (coupled DP replicas: the groups
    across replicas form again before the engine's next call), or the group was replaced or destroyed. Its
    handles raise this rather than give None, which torch would read as the default group: a silent wrong sum."""


class _Probe(msgspec.Struct, frozen=True):
    name: str
    token: bytes


_probe_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_Probe))


class Group:
    """Ranks `ranks` (global) of which this process is `rank`, over gloo process group `cpu_group`.

    `advertise_ip` is the address this rank binds its TCP publishers to (the
    one that routes toward the master). `queue_timeout_s` bounds the
    handshakes of the queues it builds.
    """

    def __init__(
        self,
        ranks: list[int],
        rank: int,
        cpu_group: Any,
        *,
        name: str = "group",
        advertise_ip: str = "127.0.0.1",
        force_remote: bool | None = None,
        queue_timeout_s: float = 120.0,
    ) -> None:
        if rank not in ranks:
            raise GroupError(f"rank {rank} is not in the {name} group {ranks}")
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self._cpu = self._dev = cpu_group
        #: why this rank left the group (`leave`): its handles raise GroupLeft from then on
        self.left: str | None = None
        self.advertise_ip = advertise_ip
        if force_remote is None:
            force_remote = settings.get(FORCE_REMOTE_ENV)
        self.force_remote = force_remote
        self.queue_timeout_s = queue_timeout_s
        self._queues: list[MessageQueue] = []

    def __repr__(self) -> str:
        return f"<Group {self.name} ranks={self.ranks} me={self.rank_in_group}{' left' if self.left else ''}>"

    @property
    def cpu_group(self) -> Any:
        """The gloo process group of these ranks (the control plane's bytes)."""
        if self.left is not None:
            raise GroupLeft(self.left)
        return self._cpu

    @cpu_group.setter
    def cpu_group(self, pg: Any) -> None:
        self._cpu = pg

    @property
    def device_group(self) -> Any:
        """The process group for tensors on this rank's device: `cpu_group` itself on CPU; NCCL's (or the
        `device_backend`'s) group of the same ranks when parallel_state built the pair."""
        if self.left is not None:
            raise GroupLeft(self.left)
        return self._dev

    @device_group.setter
    def device_group(self, pg: Any) -> None:
        self._dev = pg

    def halves(self) -> tuple[Any, Any]:
        """Both process groups, left or not (their owner releases them)."""
        return self._cpu, self._dev

    def leave(self, why: str) -> None:
        """From now on this group's handles raise GroupLeft(`why`) (the first reason given stays)."""
        if self.left is None:
            self.left = why

    # -- byte collectives --------------------------------------------------------

    def _g(self, i: int) -> int:
        return self.ranks[i]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """`data` from group rank `src` to every rank."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            assert data is not None
            return data
        me = self.rank_in_group == src
        if me and data is None:
            raise GroupError("broadcast_bytes: the source rank must give the bytes")
        n = torch.tensor([len(data) if me and data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, self._g(src), group=self.cpu_group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if me and data
            else torch.empty(int(n.item()), dtype=torch.uint8)
        )
        if n.item():
            dist.broadcast(buf, self._g(src), group=self.cpu_group)
        return data if me and data is not None else _to_bytes(buf)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in group-rank order, on every rank."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return [data]
        sizes, mine = self._padded(data)
        out = [torch.empty(mine.numel(), dtype=torch.uint8) for _ in range(self.world_size)]
        if mine.numel():
            dist.all_gather(out, mine, group=self.cpu_group)
        return [_to_bytes(t[:s]) for t, s in zip(out, sizes)]

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        """Every rank's `data` on group rank `dst` (None elsewhere)."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return [data]
        sizes, mine = self._padded(data)
        is_dst = self.rank_in_group == dst
        out = [torch.empty(mine.numel(), dtype=torch.uint8) for _ in range(self.world_size)] if is_dst else None
        if mine.numel():
            dist.gather(mine, out, dst=self._g(dst), group=self.cpu_group)
        if not is_dst:
            return None
        if not mine.numel():
            return [b""] * self.world_size
        assert out is not None
        return [_to_bytes(t[:s]) for t, s in zip(out, sizes)]

    def _padded(self, data: bytes) -> tuple[list[int], torch.Tensor]:
        """Every rank's size, and `data` as a uint8 tensor padded to the largest (collectives need one size)."""
        import torch
        import torch.distributed as dist

        n = torch.tensor([len(data)], dtype=torch.int64)
        all_n = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(all_n, n, group=self.cpu_group)
        sizes = [int(t.item()) for t in all_n]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return sizes, mine

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    # -- topology --------------------------------------------------------------------

    def same_node_as(self, source_rank: int = 0) -> list[bool]:
        """For each group rank: can it open a shared-memory segment that `source_rank` made?"""
        if self.force_remote or self.world_size == 1:
            return [i == source_rank for i in range(self.world_size)]
        is_src = self.rank_in_group == source_rank
        name = token = None
        if is_src:
            name, token = create_probe()
        try:
            mine = _probe_codec[0].encode(_Probe(name, token)) if name is not None and token is not None else None
            raw = self.broadcast_bytes(mine, source_rank)
            probe = _probe_codec[1].decode(raw)
            seen = True if is_src else check_probe(probe.name, probe.token)
            flags = self.all_gather_bytes(b"\x01" if seen else b"\x00")
        finally:
            if is_src and name:
                remove_probe(name)
        return [f == b"\x01" for f in flags]

    # -- queues ------------------------------------------------------------------------

    def create_mq_broadcaster(
        self,
        writer_rank: int = 0,
        external_writer_handle: Handle | bytes | None = None,
        blocking: bool = True,
        **queue_kwargs: Any,
    ) -> MessageQueue:
        """A queue from one writer to every rank: shared memory on the writer's node, TCP elsewhere.

        With `external_writer_handle` (held by group rank `writer_rank`), the
        writer is outside the group (the executor): that rank relays the
        handle and every rank, itself included, attaches as a reader.
        Otherwise group rank `writer_rank` creates the queue and the others read.
        """
        if not 0 <= writer_rank < self.world_size:
            raise GroupError(f"writer_rank={writer_rank} is not a rank of {self!r}")
        me = self.rank_in_group
        # Only the writer rank knows which case this is: it tells the others first.
        external = external_writer_handle is not None
        external = (
            self.broadcast_bytes((b"E" if external else b"O") if me == writer_rank else None, writer_rank) == b"E"
        )
        if external:
            raw = None
            if me == writer_rank:
                raw = (
                    external_writer_handle.to_bytes()
                    if isinstance(external_writer_handle, Handle)
                    else bytes(external_writer_handle or b"")
                )
            handle, nonce = Handle.from_signed(self.broadcast_bytes(raw, writer_rank))
            if handle.n_reader != self.world_size:
                raise GroupError(
                    f"the external writer's queue has {handle.n_reader} readers but {self!r} has "
                    f"{self.world_size} ranks: make the queue with n_reader={self.world_size}"
                )
            mq = MessageQueue.create_from_handle(handle, me, _nonce=nonce, spin_us=queue_kwargs.get("spin_us"))
        else:
            mq = self._own_broadcaster(writer_rank, **queue_kwargs)
        self._queues.append(mq)
        if blocking:
            mq.wait_until_ready(timeout=self.queue_timeout_s)
        return mq

    def _own_broadcaster(self, writer_rank: int, **queue_kwargs: Any) -> MessageQueue:
        me = self.rank_in_group
        local = self.same_node_as(writer_rank)
        readers = [i for i in range(self.world_size) if i != writer_rank]
        if me == writer_rank:
            local_idx = [k for k, i in enumerate(readers) if local[i]]
            mq = MessageQueue(len(readers), len(local_idx), local_idx, connect_ip=self.advertise_ip, **queue_kwargs)
            self.broadcast_bytes(mq.export_handle().to_bytes(), writer_rank)
            return mq
        raw = self.broadcast_bytes(None, writer_rank)
        return MessageQueue.create_from_handle(raw, readers.index(me), spin_us=queue_kwargs.get("spin_us"))

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False, **queue_kwargs: Any
    ) -> tuple[MessageQueue, list[Handle]]:
        """Each rank makes a one-reader queue toward group rank `reader_rank_in_group`'s node.

        Shared memory if this rank shares that node, else TCP. The handles are
        gathered there: that rank gets all of them (in group-rank order), the
        others an empty list. The reader may be another process on that node
        (the executor), so `blocking` defaults to False.
        """
        if not 0 <= reader_rank_in_group < self.world_size:
            raise GroupError(f"reader_rank_in_group={reader_rank_in_group} is not a rank of {self!r}")
        local = self.same_node_as(reader_rank_in_group)
        queue_kwargs.setdefault("max_chunk_bytes", 4 << 20)
        queue_kwargs.setdefault("max_chunks", 8)
        mq = MessageQueue(1, 1 if local[self.rank_in_group] else 0, connect_ip=self.advertise_ip, **queue_kwargs)
        self._queues.append(mq)
        raw = self.gather_bytes(mq.export_handle().to_bytes(), reader_rank_in_group)
        handles = [Handle.from_bytes(h) for h in raw] if raw is not None else []
        if blocking:
            mq.wait_until_ready(timeout=self.queue_timeout_s)
        return mq, handles

    # -- lifetime ----------------------------------------------------------------------

    def destroy(self) -> None:
        """Close the queues this group built and release its process group."""
        import torch.distributed as dist

        for mq in self._queues:
            try:
                mq.close()
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                logger.warning("closing %r: %s", mq, e)
        self._queues.clear()
        pg, self._cpu = self._cpu, None
        if pg is not None and pg is not dist.group.WORLD and dist.is_initialized():
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # noqa: BLE001
                logger.debug("destroying %s process group: %s", self.name, e)


def _to_bytes(t: torch.Tensor) -> bytes:
    import ctypes

    n = t.numel()
    return ctypes.string_at(t.data_ptr(), n) if n else b""
