"""Testing an engine on simulated nodes: the tensor-parallel layer of tp_layer.py, served by tp_serve.py, on two
nodes with one rank each (run from this folder: `pytest test_simulated_cluster.py`; as root each node has its
own network namespace and /dev/shm)."""

import signal


def test_the_engine_runs_across_two_nodes(rayfree_cluster):
    cluster = rayfree_cluster(2, worker="tp_layer:TPLinearWorker", entry="tp_serve:main", tp=2)
    result = cluster.nodes[0].json_after("RESULT", timeout=300)
    assert result == {"steps": 10, "equal": 10, "nodes": [0, 1]}, cluster.output()
    assert cluster.wait(timeout=120) == [0, 0], cluster.output()


def test_a_lost_node_fails_the_whole_cluster(rayfree_cluster):
    cluster = rayfree_cluster(
        2,
        worker="tp_layer:TPLinearWorker",
        entry="tp_serve:main",
        tp=2,
        env={"RAYFREE_LOG_LEVEL": "INFO", "TP_SERVE_IDLE_S": "120"},
    )
    cluster.nodes[0].expect("^RESULT:", timeout=300)  # its steps are done; it idles until the loss stops it
    cluster.nodes[1].kill(signal.SIGKILL)
    codes = cluster.wait(timeout=60)
    assert codes[0] != 0, cluster.output()


def test_a_lost_replica_rejoins_when_its_node_is_started_again(rayfree_cluster):
    """Two independent DP replicas, one node each: replica 1's node is lost and the other replica serves on;
    started again with the same command (`restart`, as its launcher would), it rejoins in epoch 1."""
    cluster = rayfree_cluster(
        2,
        worker="tp_layer:TPLinearWorker",
        entry="tp_serve:main",
        dp=2,
        env={"TP_SERVE_IDLE_S": "120"},  # (each replica idles after its steps, as an engine between requests)
    )
    for node in cluster.nodes:
        assert node.json_after("RESULT", timeout=300)["equal"] == 10, cluster.output()
    cluster.nodes[1].kill(signal.SIGKILL)
    cluster.nodes[0].expect(r"DP replica 1 was lost", timeout=60)
    again = cluster.restart(1)
    assert again.json_after("RESULT", timeout=300) == {"steps": 10, "equal": 10, "nodes": [1]}, cluster.output()
    cluster.nodes[0].expect(r"DP replica 1 rejoined \(epoch 1\)", timeout=60)
    assert cluster.nodes[0].returncode is None  # (replica 0 served on throughout)
