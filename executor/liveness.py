"""Node liveness for a multi-node executor: the leader's heartbeat server or a follower's client, wired to
the executor's failure policy (a lost follower fails the leader; a lost or failed leader stops a follower)."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from rayfree.cluster.heartbeat import HeartbeatClient, HeartbeatServer
from rayfree.transport import get_ip
from rayfree.transport.net import bind_address

from .errors import LeaderLost, NodeLost

if TYPE_CHECKING:
    from .multiproc import MultiprocExecutor

__all__ = ["start_heartbeat"]

logger = logging.getLogger("rayfree.executor")


def start_heartbeat(ex: MultiprocExecutor) -> HeartbeatServer | HeartbeatClient:
    """Start this node's side of the heartbeats; callbacks hold the executor weakly."""
    par, cfg = ex.parallel_config, ex.config
    port = cfg.heartbeat_endpoint_port
    per_node = par.local_ranks
    me = weakref.ref(ex)

    def fail(error: Exception) -> None:
        x = me()
        if x is not None:
            x._fast_stop = True  # a node is gone: its peers may hang in gloo, so do not wait long for them
            x._fail(error)

    if ex.is_leader:
        followers = {k: list(range(k * per_node, (k + 1) * per_node)) for k in range(1, par.nnodes_within_dp)}
        server = HeartbeatServer(bind_address(par.master_addr), port, followers, cfg.heartbeat_interval_s,
                                 cfg.heartbeat_timeout_s, lambda node, ranks, ip, why: fail(NodeLost(node, ranks, ip,
                                                                                                     why)))
        logger.info("leader: heartbeat endpoint %s; waiting for %d follower node(s) to join (join_timeout_s=%.0f)",
                    server.endpoint, len(followers), cfg.join_timeout_s)
        return server
    node = par.node_rank_within_dp
    ranks = list(range(par.global_start_rank, par.global_start_rank + per_node))

    def leader_bye(_node: int, clean: bool, reason: str) -> None:
        x = me()
        if x is None:
            return
        if clean:
            logger.info("node %d: the leader shut down; stopping this node's workers", node)
            x.shutdown()
        else:
            fail(LeaderLost(node, f"it stopped after a failure: {reason}"))

    client = HeartbeatClient(par.master_addr, port, node, ranks, get_ip(peer=par.master_addr),
                             cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s,
                             lambda why: fail(LeaderLost(node, why)), leader_bye)
    logger.info("node %d: waiting for the leader (node 0) at %s:%d (heartbeats at %s) to form the world "
                "(join_timeout_s=%.0f)", node, par.master_addr, par.master_port, client.endpoint, cfg.join_timeout_s)
    return client

