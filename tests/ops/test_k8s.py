"""deploy/k8s/: every manifest matches the Kubernetes and LeaderWorkerSet schemas (tests/ops/k8s_schema.json),
its probes ask the port its command serves, and the LeaderWorkerSet's own commands, run on simulated nodes with
the environment LeaderWorkerSet gives each pod and the secret where the manifest mounts it, form a cluster whose
probes answer as the manifest expects; a lost pod makes the other exit non-zero (the group is then recreated)."""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import jsonschema
import pytest
import yaml

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from rayfree.transport.secure import policy as security
from tests.support.nodes import ROOT, NodeProc, shm_files, until_unready, wait_group_empty
from tests.support.paths import PYTHONPATH

K8S = os.path.join(ROOT, "deploy", "k8s")
MANIFESTS = sorted(f for f in os.listdir(K8S) if f.endswith(".yaml"))
with open(os.path.join(os.path.dirname(__file__), "k8s_schema.json")) as f:
    SCHEMA = json.load(f)


def docs(name: str) -> list[dict]:
    with open(os.path.join(K8S, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        t = spec["leaderWorkerTemplate"]
        return [
            c for tmpl in (t.get("leaderTemplate"), t["workerTemplate"]) if tmpl for c in tmpl["spec"]["containers"]
        ]
    if doc["kind"] == "StatefulSet":
        return spec["template"]["spec"]["containers"]
    return []


def test_there_are_the_three_forms() -> None:
    assert MANIFESTS == ["lws-vllm.yaml", "lws.yaml", "statefulset.yaml"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_each_manifest_matches_the_schemas(name) -> None:
    for doc in docs(name):
        jsonschema.validate(doc, SCHEMA)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    doc = copy.deepcopy(docs("lws.yaml")[0])
    c = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    c["readynessProbe"] = c.pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError, match="readynessProbe"):
        jsonschema.validate(doc, SCHEMA)
    doc = copy.deepcopy(docs("lws.yaml")[0])
    doc["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


@pytest.mark.parametrize("name", MANIFESTS)
def test_probes_ask_the_port_the_command_serves_and_the_ring_and_secret_are_mounted(name) -> None:
    for doc in docs(name):
        for c in containers(doc):
            text = " ".join(c["command"])
            port = "8000" if " serve " in text else text.split("--health-port", 1)[1].split()[0].strip('";')
            for probe in ("readinessProbe", "livenessProbe"):
                assert str(c[probe]["httpGet"]["port"]) == port, (name, c["name"], probe)
            paths = {c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]}
            assert paths in ({"/readyz", "/livez"}, {"/health"}), paths
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/dev/shm", security.DOCKER_SECRET} <= mounts, mounts


def argv_of(container: dict) -> list[str]:
    command = container["command"]
    assert command[0] == "rayfree", command
    return [sys.executable, "-m", "rayfree.cli", *command[1:]]


def pod_env(container: dict, index: int, size: int) -> dict[str, str]:
    """What LeaderWorkerSet puts in every container of group 0, plus the container's own env."""
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return {
        "LWS_LEADER_ADDRESS": "rayfree-0.rayfree.default",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(index),
        "LWS_NAME": "rayfree",
        **env,
        "PYTHONPATH": PYTHONPATH,
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "RAYFREE_LOG_LEVEL": "INFO",
    }


@pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")
@pytest.mark.timeout(240)
def test_the_leaderworkerset_commands_form_a_cluster_on_simulated_pods(tmp_path) -> None:
    (lws,) = docs("lws.yaml")
    t = lws["spec"]["leaderWorkerTemplate"]
    size = t["size"]
    leader, worker = t["leaderTemplate"]["spec"]["containers"][0], t["workerTemplate"]["spec"]["containers"][0]
    secret = str(tmp_path / "secret")
    security.write_secret(secret)
    mount = next(m for m in leader["volumeMounts"] if m["name"] == "secret")["mountPath"]
    names = ["rayfree-0"] + [f"rayfree-0-{k}" for k in range(1, size)]  # LeaderWorkerSet's pod names
    with SimulatedCluster(
        size, hostnames=names, aliases={"rayfree-0.rayfree.default": 0}, files={mount: secret}
    ) as sim:
        pods = [
            NodeProc(
                sim.nodes[k], argv_of(leader if k == 0 else worker), pod_env(leader if k == 0 else worker, k, size)
            ).start()
            for k in range(size)
        ]
        for p in pods:
            p.others = pods
        pods[0].expect("placed by lws", 60)
        probes = {}
        for k, c in enumerate((leader, worker)):
            for kind in ("readinessProbe", "livenessProbe"):
                get = c[kind]["httpGet"]
                url = f"http://{sim.nodes[k].ip}:{get['port']}{get['path']}"
                probes[k, kind] = NodeProc(sim.nodes[k], [sys.executable, "-m", "tests.support.probe", url], {}).start()
        for (k, _kind), p in probes.items():
            m = p.expect(r"^PROBE 200 (\S+) (.*)$", 120)
            assert json.loads(m.group(2))["node"] == k
        assert "node 1/2 (follower)" in pods[1].text() and "LWS_WORKER_INDEX=1" in pods[1].text()
        pods[0].expect(r"workers on 2 node\(s\) ready", 30)
        t0 = time.monotonic()
        sim.nodes[1].kill()  # the worker pod is lost
        unready, why = until_unready(probes[0, "readinessProbe"], pods[0], 10)
        code = pods[0].wait(30)
        took = time.monotonic() - t0
        assert code != 0, pods[0].text()[-3000:]
        assert "node 1" in why, (why, pods[0].text()[-4000:])
        assert not wait_group_empty(pods[0].p.pid, 15) and not shm_files(sim.nodes[0])
    print(
        f"\nLWS pods: leader not ready {unready - t0:.2f} s after the worker pod died, exit {code} after {took:.1f} s"
    )


def sts_env(container: dict, index: int, namespace: str) -> dict[str, str]:
    """The StatefulSet pod's env as the kubelet makes it: fieldRefs resolved, $(VAR) expanded."""
    fields = {"metadata.labels['apps.kubernetes.io/pod-index']": str(index), "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for e in container["env"]:
        value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e["value"]
        for k, v in env.items():
            value = value.replace(f"$({k})", v)
        env[e["name"]] = value
    return {**env, "PYTHONPATH": PYTHONPATH, "TORCH_CPP_LOG_LEVEL": "ERROR", "RAYFREE_LOG_LEVEL": "INFO"}


@pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")
@pytest.mark.timeout(240)
def test_the_statefulset_commands_form_a_cluster_on_simulated_pods(tmp_path) -> None:
    service, sts = docs("statefulset.yaml")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    n = sts["spec"]["replicas"]
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    script = c["command"][2].replace("exec rayfree ", f"exec {sys.executable} -m rayfree.cli ")
    secret = str(tmp_path / "secret")
    security.write_secret(secret)
    names = [f"rayfree-{k}" for k in range(n)]
    with SimulatedCluster(
        n,
        hostnames=names,
        aliases={"rayfree-0.rayfree.default.svc.cluster.local": 0},
        files={security.DOCKER_SECRET: secret},
    ) as sim:
        pods = [NodeProc(sim.nodes[k], ["sh", "-c", script], sts_env(c, k, "default")).start() for k in range(n)]
        for p in pods:
            p.others = pods
        get = c["readinessProbe"]["httpGet"]
        probes = [
            NodeProc(
                sim.nodes[k],
                [sys.executable, "-m", "tests.support.probe", f"http://127.0.0.1:{get['port']}{get['path']}"],
                {},
            ).start()
            for k in range(n)
        ]
        for p in probes:
            p.expect(r"^PROBE 200 ", 120)
        pods[0].expect(r"workers on 2 node\(s\) ready", 30)
        sim.nodes[1].kill()
        assert pods[0].wait(30) != 0, pods[0].text()[-3000:]
    assert "node 1/2 (follower)" in pods[1].text()
