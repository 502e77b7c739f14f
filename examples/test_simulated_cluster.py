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
