"""Which nodes serve on when node 0 is lost (executor/follower_liveness.py `outlives_node_0`), and whether a node 0
started again resumes the cluster (`node_0_resumes`), by layout: a table, no I/O. The simulated-node runs of the rule
are in tests/cluster/test_node0_lost.py and test_dp.py."""

from __future__ import annotations

import pytest

from rayfree.cluster.config import ParallelConfig
from rayfree.executor.follower_liveness import node_0_resumes, outlives_node_0

# (nnodes, dp, tp, coupling, expert parallel, watch fan-out) -> the nodes 1.. that serve on
TABLE = [
    ((3, 3, 1, "independent", False, 0), [1, 2]),  # a replica per node
    ((2, 4, 1, "independent", False, 0), [1]),  # two replicas per node, each on it alone
    ((3, 3, 1, "auto", False, 0), [1, 2]),  # auto without expert parallelism is independent
    ((4, 2, 2, "independent", False, 0), []),  # each replica over two nodes: node 0 is their hub
    ((3, 3, 1, "coupled", False, 0), []),  # groups across replicas re-form as node 0 declares
    ((3, 3, 1, "auto", True, 0), []),  # auto with expert parallelism is coupled
    ((3, 3, 1, "one-world", False, 0), []),  # one world fails together
    ((2, 1, 2, "independent", False, 0), []),  # one replica over two nodes
    # the watch on: a replica spread over nodes that watch each other serves on, unless node 0 is one of them
    ((4, 2, 2, "independent", False, 8), [2, 3]),
    ((6, 2, 3, "independent", False, 1), [3, 4, 5]),  # a chain of watchers
    ((6, 3, 2, "independent", False, 8), [2, 3, 4, 5]),
    ((4, 2, 2, "coupled", False, 8), []),  # the groups across replicas still re-form as node 0 declares
    ((4, 2, 2, "one-world", False, 8), []),
    ((2, 1, 2, "independent", False, 8), []),
    ((3, 3, 1, "independent", False, 8), [1, 2]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "layout,serving", TABLE, ids=[f"{a}x{b}-tp{c}-{d}{'-ep' if e else ''}-watch{f}" for (a, b, c, d, e, f), _ in TABLE]
)
def test_which_nodes_serve_on_when_node_0_is_lost(layout: tuple, serving: list[int]) -> None:
    nnodes, dp, tp, coupling, ep, fanout = layout
    got = []
    for node in range(nnodes):
        par = ParallelConfig(
            nnodes=nnodes, node_rank=node, data_parallel_size=dp, tensor_parallel_size=tp, replica_coupling=coupling,
            enable_expert_parallel=ep,
        )  # fmt: skip
        if outlives_node_0(par, fanout):
            got.append(node)
    assert got == serving


# every node outside node 0's own replica serves on without it: a node 0 started again resumes the cluster (node 0's
# replica's other nodes, which left with it, are started again with it)
RESUMES = [
    ((3, 3, 1, "independent", False, 0), True),
    ((2, 4, 1, "independent", False, 0), True),
    ((4, 2, 2, "independent", False, 0), False),  # replica 1's nodes stop with node 0: nothing to resume
    ((4, 2, 2, "independent", False, 8), True),  # replica 1 watches itself; node 1 comes back with node 0
    ((6, 3, 2, "independent", False, 1), True),
    ((4, 2, 2, "coupled", False, 8), False),
    ((3, 3, 1, "one-world", False, 0), False),
    ((2, 1, 2, "independent", False, 8), False),  # one replica: node 0's own, and nobody else
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "layout,resumes", RESUMES, ids=[f"{a}x{b}-tp{c}-{d}-watch{f}" for (a, b, c, d, e, f), _ in RESUMES]
)
def test_whether_node_0_started_again_resumes_the_cluster(layout: tuple, resumes: bool) -> None:
    nnodes, dp, tp, coupling, ep, fanout = layout
    par = ParallelConfig(
        nnodes=nnodes, data_parallel_size=dp, tensor_parallel_size=tp, replica_coupling=coupling,
        enable_expert_parallel=ep,
    )  # fmt: skip
    assert node_0_resumes(par, fanout) is resumes
