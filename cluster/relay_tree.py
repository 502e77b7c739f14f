"""How each rank of a replica that spans nodes reads the leader's broadcast: flat, or through its node's relay.

Flat: every rank subscribes to node 0 itself. Relay (the default): node 0's
ranks read its ring, a follower node's ranks read the ring of their node's
relay (transport/relay), and each relay subscribes to node 0 or, past the
fan-out, to its parent node's relay. One all-gather over the replica's group
carries what that needs: each node's first rank offers its handle (node 0's
the leader's queue, a follower's its relay's ring, whose remote endpoint is
where its child nodes subscribe), with its node's mode and fan-out, so nodes
set up differently are told so, by node, instead of waiting out a handshake.
"""

from __future__ import annotations

import msgspec

from rayfree.transport import Handle, MessageQueue
from rayfree.transport.relay import tree

from .config import ClusterConfig
from .group import Group, GroupError

__all__ = ["attach_broadcast", "relay_children", "runs_relay"]


class _Offer(msgspec.Struct, array_like=True, frozen=True):
    node: int
    mode: str
    fanout: int
    handle: bytes


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Offer)


def relay_children(config: ClusterConfig, node: int) -> list[int]:
    """The reader ids (each child node's first rank) node `node` of the replica sends the broadcast to."""
    par = config.parallel
    return [c * par.local_ranks for c in tree.children(node, par.nnodes_within_dp, config.relay_fanout)]


def runs_relay(config: ClusterConfig, node: int) -> bool:
    """Does follower node `node` run a relay? Only with ranks to share it or child nodes to pass it on to: a
    lone rank with no children is its node's one stream, and subscribes to its parent itself (no extra hop)."""
    return config.parallel.local_ranks > 1 or bool(relay_children(config, node))


def attach_broadcast(
    group: Group, config: ClusterConfig, local_rank: int, handle: bytes | None
) -> tuple[MessageQueue, tuple[bytes, str] | None]:
    """This rank's reader of the leader's broadcast (not yet ready), and, on a follower node's first rank with
    relays, (the leader's handle, the endpoint its node's relay subscribes to), for its node process."""
    par = config.parallel
    node = par.node_rank_within_dp
    mine = _Offer(node, config.broadcast, config.relay_fanout, (handle or b"") if local_rank == 0 else b"")
    offers = [_dec.decode(raw) for raw in group.all_gather_bytes(_enc.encode(mine))]
    _agree([offers[k * par.local_ranks] for k in range(par.nnodes_within_dp)])
    leader = offers[0].handle
    spin, shared = config.spin_us, config.shared_arguments
    if config.broadcast == "flat":
        return MessageQueue.create_from_handle(leader, group.rank_in_group, spin_us=spin, zero_copy=shared), None
    if node != 0:
        up = tree.parent(node, config.relay_fanout)
        endpoint = Handle.from_bytes(leader if up == 0 else offers[up * par.local_ranks].handle).remote_endpoint
        if not endpoint:
            raise GroupError(f"node {node}'s parent node {up} offered no endpoint for its child nodes")
        if handle is None:  # no relay here (runs_relay): this lone rank reads its parent's stream itself
            direct = msgspec.structs.replace(Handle.from_bytes(leader), remote_endpoint=endpoint)
            return MessageQueue.create_from_handle(direct, group.rank_in_group, spin_us=spin), None
    elif handle is None:
        raise GroupError(f"rank {group.rank}: started without the broadcast queue's handle")
    rank = group.rank_in_group if node == 0 else local_rank
    mq = MessageQueue.create_from_handle(handle, rank, spin_us=spin, zero_copy=shared)
    return mq, (leader, endpoint) if node != 0 and local_rank == 0 else None


def _agree(offers: list[_Offer]) -> None:
    """Every node broadcasts the same way, or a GroupError naming each node's setting."""
    ways = {(o.mode, o.fanout) for o in offers}
    if len(ways) > 1:
        said = ", ".join(f"node {o.node}: broadcast={o.mode} relay_fanout={o.fanout}" for o in offers)
        raise GroupError(
            f"the nodes disagree on how broadcasts travel ({said}): set RAYFREE_BROADCAST and "
            f"RAYFREE_RELAY_FANOUT (or broadcast and relay_fanout in the config file) the same on every node"
        )
