"""The torchrun-compatible variables a rank's process carries for the world it joins.

Libraries outside rayfree find their rank from the environment, as torchrun
sets it: transformers' `tp_plan="auto"` and accelerate read `RANK`,
`LOCAL_RANK` and `WORLD_SIZE`, torch's DeviceMesh helpers and env://
rendezvous read `MASTER_ADDR` / `MASTER_PORT`. Without them every rank thinks
it is alone and loads the whole model, silently. These are the values for the
world rayfree's workers join (their DP replica's ranks, or every replica's
when the replicas share one world), set in the worker before any engine code
runs; docs/workers.md lists them. `LOCAL_RANK` counts every rank of the node
either way: it picks a device.
"""

from __future__ import annotations

from urllib.parse import urlparse

from .config import ParallelConfig

__all__ = ["LAUNCHER_VARIABLES", "launcher_environment", "node_local_rank"]

#: what rayfree sets in every worker (and nothing else of torchrun's)
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "NODE_RANK",
)


def node_local_rank(par: ParallelConfig, local_rank: int) -> int:
    """This process's index among every rank on its node: DP replicas that share a node follow each other
    (replica k's ranks after replica k-1's), so no two processes of a node share an index."""
    replicas = par.node_replicas
    slot = replicas.index(par.dp_rank) if par.dp_rank in replicas else 0
    return slot * par.local_ranks + local_rank


def launcher_environment(par: ParallelConfig, rank: int, local_rank: int, init_method: str) -> dict[str, str]:
    """The variables of `LAUNCHER_VARIABLES` for rank `rank` of this executor's replica (`local_rank` its index
    among the replica's ranks on this node), whose world meets at `init_method` (tcp://host:port)."""
    where = urlparse(init_method)
    whole = par.one_world  # (one replica: its world is the whole one)
    node = par.node_rank if whole else par.node_rank_within_dp
    return {
        "RANK": str(par.global_rank(rank) if whole else rank),
        "LOCAL_RANK": str(node_local_rank(par, local_rank)),
        "WORLD_SIZE": str(par.world_size_across_dp if whole else par.world_size),
        "LOCAL_WORLD_SIZE": str(par.local_ranks * len(par.node_replicas)),
        "MASTER_ADDR": where.hostname or par.master_addr,
        "MASTER_PORT": str(where.port or par.master_port),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(par.nnodes if whole else par.nnodes_within_dp),
        "NODE_RANK": str(node),
    }
