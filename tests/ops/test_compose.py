"""docker-compose.yml cannot rot: its invocations are the ones the tests and the demo run.

tests/cluster/test_multinode.py starts its nodes with `compose_invocation("head" / "follower")`, i.e. with
the command and environment read from this file; here the rest is checked: GPU reservations, shared
memory, host networking, the healthcheck, the CPU profile, and that `rayfree demo` runs the same thing.
"""

from __future__ import annotations

import os

from rayfree.cli.cluster_demo import node_command, node_env
from rayfree.cluster.config import ClusterConfig, ParallelConfig
from tests.support.nodes import ROOT, compose, compose_invocation

NODE_OPTIONS = {"RAYFREE_WORKER", "RAYFREE_ENTRY", "RAYFREE_HEADLESS", "RAYFREE_WORKER_KWARGS", "RAYFREE_HEALTH_PORT"}
CONFIG_OPTIONS = {"RAYFREE_" + f.upper() for f in (*ParallelConfig.__struct_fields__, *ClusterConfig.__struct_fields__)}
VALUES = {"RAYFREE_MASTER_ADDR": "10.0.0.1", "RAYFREE_MASTER_PORT": "29500"}


def test_gpu_services_reserve_gpus_share_memory_and_use_the_host_network() -> None:
    services = compose()["services"]
    for name in ("head", "follower", "leader"):
        svc = services[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), name
        assert svc.get("ipc") == "host" or svc.get("shm_size"), f"{name}: /dev/shm would be docker's 64 MB"
        assert svc["ulimits"]["memlock"] == -1, f"{name}: pinned memory and RDMA need memlock unlimited"
        assert svc.get("network_mode") == "host", f"{name}: multi-node needs the hosts' network"
        assert svc["healthcheck"]["test"][1:] == ["rayfree", "doctor", "--quick"], name
        assert "profiles" not in svc


def test_every_service_gets_the_cluster_secret_as_a_compose_secret() -> None:
    doc = compose()
    assert "file" in doc["secrets"]["rayfree_secret"]
    for name, svc in doc["services"].items():
        assert svc.get("secrets") == ["rayfree_secret"], f"{name}: without the secret a node refuses to start"
        assert "RAYFREE_INSECURE" not in (svc.get("environment") or {}), name


def test_every_variable_is_an_option_rayfree_reads() -> None:
    for name, svc in compose()["services"].items():
        for key in svc.get("environment") or {}:
            if key.startswith("RAYFREE_"):
                assert key in NODE_OPTIONS | CONFIG_OPTIONS, f"{name}: {key} is not a rayfree option (typo?)"


def test_the_vllm_profile_serves_vllm_on_node_0_and_vllm_s_worker_headless_on_the_others() -> None:
    services = compose()["services"]
    head, follower = services["vllm-head"], services["vllm-follower"]
    assert head["profiles"] == follower["profiles"] == ["vllm"]
    assert head["command"][:2] == ["vllm", "serve"]
    assert "rayfree.integrations.vllm.RayfreeExecutor" in head["command"]
    assert follower["command"][:3] == ["rayfree", "node", "--headless"]
    assert "rayfree.integrations.vllm:VllmWorker" in follower["command"]
    assert head["environment"]["RAYFREE_NODE_RANK"] == "0" and "RAYFREE_HEALTH_PORT" in follower["environment"]
    port = follower["environment"]["RAYFREE_HEALTH_PORT"]
    assert f"127.0.0.1:{port}/readyz" in follower["healthcheck"]["test"][-1]
    for svc in (head, follower):
        assert svc["network_mode"] == "host" and svc["ipc"] == "host"


def test_cpu_profile_runs_the_same_nodes_on_one_machine() -> None:
    services = compose()["services"]
    for gpu, cpu in (("head", "head-cpu"), ("follower", "follower-cpu")):
        g_argv, g_env = compose_invocation(gpu, {**VALUES, "RAYFREE_NODE_RANK": "1"})
        c_argv, c_env = compose_invocation(cpu, VALUES)
        svc = services[cpu]
        assert svc["profiles"] == ["cpu"] and svc.get("shm_size"), cpu
        assert "deploy" not in svc, f"{cpu}: a CPU-only node must not reserve GPUs"
        assert c_argv == g_argv
        differ = {k for k in g_env.keys() | c_env.keys() if g_env.get(k) != c_env.get(k)}
        assert differ <= {"RAYFREE_MASTER_ADDR", "GLOO_SOCKET_IFNAME", "RAYFREE_NODE_RANK"}, (cpu, differ)
        assert c_env["RAYFREE_MASTER_ADDR"] == services["head-cpu"]["hostname"]


def test_the_demo_runs_the_compose_invocation() -> None:
    for k, service in ((0, "head"), (1, "follower")):
        argv, env = compose_invocation(service, {**VALUES, "RAYFREE_NODE_RANK": str(k)})
        assert node_command()[1:] == argv[1:]  # both: <python> -m rayfree.cli node
        demo = node_env(2, k, VALUES["RAYFREE_MASTER_ADDR"], 29500, 2, 2)
        assert {x: v for x, v in env.items() if x != "RAYFREE_HEARTBEAT_TIMEOUT_S"} == demo, service


def test_the_dp_layout_the_compose_file_shows_is_the_demo_s() -> None:
    """`rayfree demo --dp 2`: 4 nodes, replicas of TP=2 over nodes 0-1 and 2-3; head, follower, leader, follower."""
    dp = {
        **VALUES,
        "RAYFREE_NNODES": "4",
        "RAYFREE_DATA_PARALLEL_SIZE": "2",
        "RAYFREE_TENSOR_PARALLEL_SIZE": "2",
        "RAYFREE_PIPELINE_PARALLEL_SIZE": "1",
    }
    for k, service in enumerate(("head", "follower", "leader", "follower")):
        _, env = compose_invocation(service, {**dp, "RAYFREE_NODE_RANK": str(k)})
        demo = node_env(4, k, VALUES["RAYFREE_MASTER_ADDR"], 29500, 2, 1, dp=2)
        assert {x: v for x, v in env.items() if x != "RAYFREE_HEARTBEAT_TIMEOUT_S"} == demo, (k, service)
    # Without RAYFREE_NODE_RANK the leader is node 2: the first node of replica 1 in this layout (compose v1
    # interpolates the whole file for every command, so a required variable would break `up head` too).
    _, env = compose_invocation("leader", dp)
    assert env["RAYFREE_NODE_RANK"] == "2" and ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, nnodes=4, node_rank=2
    ).leads(2)


def test_the_image_installs_every_package() -> None:
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    for pkg in ("transport", "cluster", "worker", "executor", "rayfree"):
        assert f"COPY {pkg} {pkg}" in dockerfile, pkg
    assert "FROM ${BASE_IMAGE}" in dockerfile and "torch==2.13.0" in dockerfile
    # Offline from the wheelhouse (make wheelhouse), else from the indexes; numpy beside torch either way.
    assert "--no-index --find-links /tmp/wheelhouse rayfree numpy" in dockerfile
    assert "pip install --no-cache-dir numpy ." in dockerfile
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        admitted = {ln[1:] for ln in f.read().split() if ln.startswith("!")}
    assert {"transport", "cluster", "worker", "executor", "rayfree", "pyproject.toml", "docker/wheelhouse"} <= admitted
