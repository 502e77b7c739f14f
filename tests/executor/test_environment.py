"""What a worker's process carries for libraries that find their rank in the environment (torchrun's variables),
and for a worker whose world they describe."""

from __future__ import annotations

import os

import pytest

from rayfree.cluster.config import ClusterConfig, ParallelConfig
from rayfree.cluster.environment import LAUNCHER_VARIABLES
from rayfree.executor import MultiprocExecutor
from rayfree.executor.replicas import NodeReplicas
from rayfree.transport import get_open_port

ECHO = "tests.support.sample_workers:EchoWorker"


def launcher_variables(worker) -> dict[str, str]:
    import torch.distributed as dist

    env = {k: os.environ.get(k, "") for k in LAUNCHER_VARIABLES}
    env["joined"] = f"{dist.get_rank()}/{dist.get_world_size()}" if dist.is_initialized() else ""
    return env


@pytest.mark.timeout(120)
def test_every_worker_carries_torchruns_variables_for_the_world_it_joined() -> None:
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    with MultiprocExecutor(config, ECHO, {"distributed": True}) as ex:
        got = ex.collective_rpc(launcher_variables, timeout=60)
    master = got[0]["MASTER_ADDR"], got[0]["MASTER_PORT"]
    assert ex.distributed_init_method == f"tcp://{master[0]}:{master[1]}"
    for rank, env in enumerate(got):
        assert env["joined"] == f"{rank}/4", env
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "4",
            "4",
        ), env
        assert (env["GROUP_RANK"], env["NODE_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "0", "1"), env
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == master


@pytest.mark.timeout(180)
@pytest.mark.parametrize("coupling", ["one-world", "coupled", "independent"])
def test_dp_replicas_on_one_node_get_disjoint_local_ranks_and_their_worlds_ranks(coupling: str) -> None:
    """Two DP replicas of TP=2 on one node: LOCAL_RANK 0..3 over the node (not 0,1 twice, which would put both
    replicas on the first two devices); RANK and WORLD_SIZE those of the world each rank joined: the whole one
    (one-world), or its replica's (independent, and coupled: its groups across replicas rest on no world)."""
    port = get_open_port("127.0.0.1")
    par = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, master_port=port, replica_coupling=coupling)
    reps = NodeReplicas(ClusterConfig(parallel=par, ready_timeout_s=120), ECHO, {"distributed": True})
    try:
        seen = {ex.dp_rank: ex.collective_rpc(launcher_variables, timeout=60) for ex in reps.leaders}
    finally:
        reps.shutdown()
    rows = sorted(
        (int(e["LOCAL_RANK"]), int(e["RANK"]), e["joined"], e["WORLD_SIZE"]) for v in seen.values() for e in v
    )
    if coupling == "one-world":
        assert rows == [(r, r, f"{r}/4", "4") for r in range(4)], rows
    else:
        assert rows == [(r, r % 2, f"{r % 2}/2", "2") for r in range(4)], rows
    assert {e["LOCAL_WORLD_SIZE"] for envs in seen.values() for e in envs} == {"4"}
