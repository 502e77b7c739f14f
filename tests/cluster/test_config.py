"""Cluster configuration: derived values, one clear error per mistake, loading from file/env/flags."""

from __future__ import annotations

import json

import pytest

from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
from rayfree.cluster.loading import load_config


def test_derived_values() -> None:
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    assert p.validate() is p
    assert p.world_size == 4 and p.nnodes_within_dp == 2 and p.node_rank_within_dp == 1
    assert p.local_ranks == 2 and p.global_start_rank == 2
    assert p.output_rank == 2  # first TP rank of the last PP stage
    assert p.driver_ranks == [0, 2] and p.is_driver_rank(2) and not p.is_driver_rank(3)
    assert [p.node_of(r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "nnodes, dp, tp, node_replicas, replica_nodes, node_ranks",
    [
        # DP=2 of TP=2 over 4 nodes (1 rank each): replica 0 on nodes 0-1, replica 1 on nodes 2-3
        (4, 2, 2, [[0], [0], [1], [1]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]),
        # DP=2 of TP=1 on 2 nodes: a replica per node
        (2, 2, 1, [[0], [1]], [[0], [1]], [[0], [1]]),
        # DP=4 of TP=2 on 2 nodes: two whole replicas per node
        (2, 4, 2, [[0, 1], [2, 3]], [[0], [0], [1], [1]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # one node, DP=2: both replicas on it
        (1, 2, 2, [[0, 1]], [[0], [0]], [[0, 1, 2, 3]]),
    ],
)
def test_dp_replicas_over_nodes(nnodes, dp, tp, node_replicas, replica_nodes, node_ranks) -> None:
    p = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, nnodes=nnodes).validate()
    assert [p.replicas_of_node(k) for k in range(nnodes)] == node_replicas
    assert [p.nodes_of_replica(r) for r in range(dp)] == replica_nodes
    assert [p.node_ranks(k) for k in range(nnodes)] == node_ranks
    assert p.world_size_across_dp == dp * tp
    for k in range(nnodes):  # each node's executors: which replica, which world ranks, leading or not
        for r in node_replicas[k]:
            q = ParallelConfig(
                tensor_parallel_size=tp, data_parallel_size=dp, nnodes=nnodes, node_rank=k, data_parallel_rank=r
            ).validate()
            assert q.dp_rank == r and q.node_rank_within_dp == replica_nodes[r].index(k)
            assert [q.global_rank(i) for i in range(q.global_start_rank, q.global_start_rank + q.local_ranks)] == [
                g for g in node_ranks[k] if g // tp == r
            ]
            assert all(
                q.cluster_node_of(i) == k for i in range(q.global_start_rank, q.global_start_rank + q.local_ranks)
            )


def test_a_replica_that_does_not_run_on_the_node_is_refused() -> None:
    with pytest.raises(ConfigError, match="data_parallel_rank=0 does not run on node 2.*runs replica\\(s\\) \\[1\\]"):
        ParallelConfig(
            tensor_parallel_size=2, data_parallel_size=2, nnodes=4, node_rank=2, data_parallel_rank=0
        ).validate()


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (dict(tensor_parallel_size=3, nnodes=2), "not divisible by the 2 node"),
        (dict(nnodes=2, node_rank=2), "node_rank=2 is out of range"),
        (dict(nnodes=2, node_rank=-1), "node_rank=-1 is out of range"),
        (dict(tensor_parallel_size=4, nnodes=2, local_world_size=3), "local_world_size=3 does not match"),
        (dict(master_port=70000), "master_port=70000"),
        (dict(master_addr=""), "master_addr is empty"),
        (dict(tensor_parallel_size=4, decode_context_parallel_size=3), "decode_context_parallel_size=3"),
        (dict(nnodes=3, data_parallel_size=2), "one must divide the other"),
    ],
)
def test_each_mistake_has_its_own_message(kw, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        ParallelConfig(**kw).validate()


def test_master_addr_must_be_local_on_node_0() -> None:
    with pytest.raises(ConfigError, match="not an address of this machine"):
        ParallelConfig(master_addr="203.0.113.9").validate(check_local_master=True)
    ParallelConfig(master_addr="127.0.0.1").validate(check_local_master=True)
    ParallelConfig(master_addr="203.0.113.9", nnodes=2, node_rank=1, tensor_parallel_size=2).validate(
        check_local_master=True
    )


def test_cluster_timeouts_are_checked() -> None:
    with pytest.raises(ConfigError, match="join_timeout_s"):
        ClusterConfig(join_timeout_s=0).validate()
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        ClusterConfig(heartbeat_interval_s=2, heartbeat_timeout_s=1).validate()


def test_file_then_env_then_flags(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("ready_timeout_s = 30\n[parallel]\ntensor_parallel_size = 2\npipeline_parallel_size = 2\n")
    cfg = load_config(["--config", str(toml)], env={})
    assert cfg.parallel.world_size == 4 and cfg.ready_timeout_s == 30
    cfg = load_config(["--config", str(toml), "--tp", "4"], env={"RAYFREE_TENSOR_PARALLEL_SIZE": "1"})
    assert cfg.parallel.tensor_parallel_size == 4  # flag beats env beats file
    cfg = load_config(
        [],
        env={
            "RAYFREE_CONFIG": str(toml),
            "RAYFREE_FORCE_REMOTE": "true",
            "RAYFREE_RPC_TIMEOUT_S": "none",
            "RAYFREE_MASTER_ADDR": "127.0.0.1",
        },
    )
    assert cfg.force_remote is True and cfg.rpc_timeout_s is None and cfg.parallel.tensor_parallel_size == 2
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"tensor_parallel_size": 2, "heartbeat_timeout_s": 9}))
    cfg = load_config(["--config", str(js)], env={})
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.heartbeat_timeout_s == 9


def test_bad_values_in_files_and_env_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="RAYFREE_NNODES"):
        load_config([], env={"RAYFREE_NNODES": "two"})
    bad = tmp_path / "bad.toml"
    bad.write_text("tensor_parallel_size = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(bad)], env={})
    unknown = tmp_path / "u.json"
    unknown.write_text('{"tensor_paralel_size": 2}')
    with pytest.raises(ConfigError, match="tensor_paralel_size"):
        load_config(["--config", str(unknown)], env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(["--config", str(tmp_path / "missing.toml")], env={})


def test_each_value_comes_with_its_origin_from_one_resolver(tmp_path) -> None:
    """Flag over RAYFREE_* over the file, for the cluster's fields as for `rayfree node`'s [node] table, each
    value with where it came from; the file is read in that one place (cluster/loading.py)."""
    import argparse
    import os

    from rayfree.cluster.loading import resolve

    path = tmp_path / "c.toml"
    path.write_text('nnodes = 4\nmaster_port = 29600\n[parallel]\nnode_rank = 3\n[node]\nworker = "m:W"\n')
    args = argparse.Namespace(config=str(path), nnodes="2", node_rank=None, master_port=None, worker=None)
    got = resolve(args, {"RAYFREE_NODE_RANK": "1"}, ["nnodes", "node_rank", "master_port", "master_addr"])
    assert got == {
        "nnodes": ("2", "flag --nnodes"),
        "node_rank": ("1", "RAYFREE_NODE_RANK"),
        "master_port": (29600, f"config file {path}"),
    }
    assert resolve(args, {}, ["worker"], table="node") == {"worker": ("m:W", f"config file {path}")}
    assert resolve(args, {}, ["worker"], table="node")["worker"].from_file
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readers = []
    for folder in ("rayfree", "transport", "cluster", "worker", "executor"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f)) as fh:
                        if "read_config_file(" in fh.read():
                            readers.append(os.path.relpath(os.path.join(dirpath, f), root))
    assert sorted(readers) == ["cluster/config.py", "cluster/loading.py"], readers
