"""`NodeBroadcast`: this node's end of the leader's broadcast — node 0's queue, or a follower node's relay.

Node 0's queue reaches its own ranks through shared memory and the other
nodes over TCP: once per remote rank (broadcast="flat"), or once per child
node (broadcast="relay", the default), whose relay (transport/relay) writes it
into that node's ring and passes it on to its own children past the fan-out.
The executor holds this object and asks it three things: the handle its
workers start with, what to do with a worker's READY, and its status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rayfree.cluster.config import ClusterConfig
from rayfree.cluster.relay_tree import relay_children, runs_relay
from rayfree.transport import Handle, MessageQueue, get_ip
from rayfree.transport.relay.relay import Relay

__all__ = ["NodeBroadcast"]

logger = logging.getLogger("rayfree.executor")


class NodeBroadcast:
    """Node 0: `queue` (the RPC pipe's broadcast). A follower with a relay: `relay`. A flat follower, or a lone
    rank with no child nodes (it subscribes itself): neither."""

    def __init__(self, config: ClusterConfig, on_broken: Callable[[Exception], None]) -> None:
        par = config.parallel
        multi_node = par.nnodes_within_dp > 1  # this replica spans nodes
        connect_ip = get_ip(peer=par.master_addr) if multi_node else "127.0.0.1"
        self.queue: MessageQueue | None = None
        self.relay: Relay | None = None
        relays = multi_node and config.broadcast == "relay"
        node = par.node_rank_within_dp
        if node == 0:
            n_local = 0 if config.force_remote and not multi_node else par.local_ranks
            self.queue = MessageQueue(
                par.world_size,
                n_local,
                list(range(n_local)),
                connect_ip=connect_ip,
                spin_us=config.spin_us,
                remote_subscribers=relay_children(config, 0) if relays else None,
            )
        elif relays and runs_relay(config, node):
            self.relay = Relay(
                par.local_ranks,
                node * par.local_ranks,
                relay_children(config, node),
                connect_ip,
                timeout_s=config.ready_timeout_s,
                spin_us=config.spin_us,
                on_broken=on_broken,
            ).start()

    def worker_handle(self) -> bytes | None:
        """What this node's workers attach to: node 0's queue, or this node's relay ring (None: flat)."""
        if self.queue is not None:
            return self.queue.export_handle().to_bytes()
        return self.relay.handle.to_bytes() if self.relay is not None else None

    def worker_ready(self, upstream: tuple[bytes, str] | None) -> None:
        """A worker's READY: the first one of a follower node says where its relay subscribes."""
        if self.relay is not None and upstream is not None:
            self.relay.connect(Handle.from_bytes(upstream[0]), upstream[1])

    def status(self) -> dict[str, Any]:
        return self.relay.status() if self.relay is not None else {}

    def close(self) -> None:
        """The relay (the queue belongs to the RPC pipe, which closes it)."""
        if self.relay is not None:
            self.relay.close()
