"""The restart contract, whatever the engine is doing: on every launcher's path, a follower node killed under an
entry that sleeps (no call in flight, no failure callback) takes node 0 out, non-zero, within about 2 s; all the
while node 0's /livez answers 200 (its process is up and leaving by itself) and its /readyz carries the failure,
both probed every 20 ms."""

from __future__ import annotations

import sys
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster, can_use_netns
from rayfree.procs import cmdline, descendants, is_alive
from tests.support.nodes import NodeProc, shm_files, until_unready, wait_group_empty
from tests.support.paths import PYTHONPATH
from tests.support.waits import wait_until

pytestmark = pytest.mark.skipif(not can_use_netns(), reason="needs root for network namespaces")

PORT = 8490
#: "within 2 s" on an idle machine (0.92-0.96 s here, alone, by this test's print); this one has two cores shared
#: with the rest of the suite, and beside a second suite node 0 took 3.4 s. The entry sleeps 120 s, so a node 0
#: that waited for it, or for anything of ours left behind, is still far past this bound.
SLACK = 4.0
#: how long torchrun's agent may take to leave after its child (node 0) did: its poll, its own teardown
TORCHRUN_AGENT_S = 10.0
ENV = {"PYTHONPATH": PYTHONPATH, "TORCH_CPP_LOG_LEVEL": "ERROR", "RAYFREE_LOG_LEVEL": "INFO", "RF_SERVE_S": "120"}
NODE = [
    "rayfree.cli", "node", "--worker", "tests.support.sample_workers:EchoWorker", "--tp", "2", "--insecure",
    "--worker-kwargs", '{"distributed": true}', "--health-port", str(PORT),
]  # fmt: skip
ENTRY = ["--entry", "tests.support.multinode_entry:idle"]


def placement(launcher: str, sim: SimulatedCluster, k: int, logs: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of node k, placed the way `launcher` places it (torchrun keeps its logs in `logs`,
    not in a directory of its own under /tmp)."""
    ips = [n.ip for n in sim.nodes]
    python = [sys.executable, "-m"]
    if launcher == "flags":
        flags = ["--nnodes", "2", "--node-rank", str(k), "--master-addr", ips[0]]
        return [*python, *NODE, *flags, *(["--headless"] if k else ENTRY)], {}
    if launcher == "torchrun":
        run = ["torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(k)]
        run += [
            "--log-dir",
            f"{logs}/torchrun-{k}",
            "--master-addr",
            ips[0],
            "--master-port",
            "29500",
            "--no-python",
            sys.executable,
            "-m",
        ]
        return [*python, *run, *NODE, *ENTRY], {}
    env = {
        "slurm": {
            "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": ",".join(ips),
            "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": str(k), "SLURM_LOCALID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        },
        "lws": {"LWS_LEADER_ADDRESS": ips[0], "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(k)},
        "skypilot": {"SKYPILOT_NODE_RANK": str(k), "SKYPILOT_NODE_IPS": "\n".join(ips), "SKYPILOT_NUM_NODES": "2"},
    }[launcher]  # fmt: skip
    return [*python, *NODE, *ENTRY], env  # one command on every node: the launcher says who leads


def probe(sim: SimulatedCluster, path: str) -> NodeProc:
    return NodeProc(
        sim.nodes[0], [sys.executable, "-m", "tests.support.probe", f"http://127.0.0.1:{PORT}/{path}", "0.02"], ENV
    ).start()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["flags", "slurm", "lws", "torchrun", "skypilot"])
def test_node_0_leaves_non_zero_within_2s_of_a_loss_while_its_entry_sleeps(launcher: str, tmp_path) -> None:
    with SimulatedCluster(2) as sim:
        nodes: list[NodeProc] = []
        for k in range(2):
            argv, env = placement(launcher, sim, k, str(tmp_path))
            nodes.append(NodeProc(sim.nodes[k], argv, {**ENV, **env}).start())
            nodes[-1].others = nodes
        nodes[0].expect("^SERVING:", 180)
        live, ready = probe(sim, "livez"), probe(sim, "readyz")
        live.others = ready.others = nodes  # their failures show the nodes' output
        live.expect("^PROBE 200 ", 30)
        ready.expect("^PROBE 200 ", 30)
        # node 0's `rayfree node` process: the one started, or torchrun's child
        mine = [nodes[0].p.pid, *descendants(nodes[0].p.pid)]
        (node0,) = [
            p for p in mine if "rayfree.cli" in cmdline(p, 2000) and "torch.distributed" not in cmdline(p, 2000)
        ]
        t0 = time.monotonic()
        sim.nodes[1].kill()
        unready, why = until_unready(ready, nodes[0], 10)
        wait_until(lambda: not is_alive(node0), 30, "node 0's rayfree node process left", every=0.005)
        took = time.monotonic() - t0
        code = nodes[0].wait(30)
        launcher_out = time.monotonic() - t0
        live.expect(r"^PROBE 0 ", 10)  # its port closed with the process
        lived = live.text()
        assert not wait_group_empty(nodes[0].p.pid, 15) and not shm_files(sim.nodes[0])
    text = nodes[0].text()
    print(f"\n{launcher}: node 0 out {took:.2f} s after node 1's kill (exit {code}, its launcher's process out after "
          f"{launcher_out:.2f} s); not ready after {unready - t0:.2f} s")  # fmt: skip
    assert code != 0, text[-3000:]
    assert "WOKE" not in text  # the entry did not simply return on its own
    assert "node 1" in why, why[-3000:]
    assert "PROBE 503" not in lived, lived  # /livez: up until the process was gone
    assert "the entry point has 0.5s (RAYFREE_ENTRY_GRACE_S) to return" in text, text[-3000:]
    assert took < 2.0 + SLACK, f"node 0 left {took:.2f}s after the loss"
    # What the launcher adds is its own: torchrun's agent notices its child's exit (every 0.1 s) and then leaves
    # through its own interpreter's teardown, torch loaded (0.8 s idle, 4.7 s beside a second suite on two
    # cores). The bound catches an agent kept waiting by something of ours (a process left behind), not its
    # speed. Every other launcher's process here is rayfree's own.
    agent_s = TORCHRUN_AGENT_S if launcher == "torchrun" else 0.5
    assert launcher_out - took < agent_s, f"{launcher}'s process left {launcher_out - took:.2f}s after node 0's"
