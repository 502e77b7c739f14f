"""Which nodes serve on when node 0 is lost (executor/follower_liveness.py `outlives_node_0`), by layout: a table,
no I/O. The simulated-node runs of the rule are in tests/cluster/test_node0_lost.py and test_dp.py."""

from __future__ import annotations

import pytest

from rayfree.cluster.config import ParallelConfig
from rayfree.executor.follower_liveness import outlives_node_0

# (nnodes, dp, tp, coupling, expert parallel) -> the nodes 1.. that serve on
TABLE = [
    ((3, 3, 1, "independent", False), [1, 2]),  # a replica per node
    ((2, 4, 1, "independent", False), [1]),  # two replicas per node, each on it alone
    ((3, 3, 1, "auto", False), [1, 2]),  # auto without expert parallelism is independent
    ((4, 2, 2, "independent", False), []),  # each replica over two nodes: node 0 is their hub
    ((3, 3, 1, "coupled", False), []),  # groups across replicas re-form as node 0 declares
    ((3, 3, 1, "auto", True), []),  # auto with expert parallelism is coupled
    ((3, 3, 1, "one-world", False), []),  # one world fails together
    ((2, 1, 2, "independent", False), []),  # one replica over two nodes
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "layout,serving", TABLE, ids=[f"{a}x{b}-tp{c}-{d}{'-ep' if e else ''}" for (a, b, c, d, e), _ in TABLE]
)
def test_which_nodes_serve_on_when_node_0_is_lost(layout: tuple, serving: list[int]) -> None:
    nnodes, dp, tp, coupling, ep = layout
    got = []
    for node in range(nnodes):
        par = ParallelConfig(
            nnodes=nnodes, node_rank=node, data_parallel_size=dp, tensor_parallel_size=tp, replica_coupling=coupling,
            enable_expert_parallel=ep,
        )  # fmt: skip
        if outlives_node_0(par):
            got.append(node)
    assert got == serving
