"""Each launcher's variables place a node as that launcher means them; what disagrees is refused in one line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from rayfree.cli.node_options import NodeUsageError, add_node_arguments, plan
from rayfree.launch.hostlist import HostlistError, expand_hostlist
from rayfree.launch.launchers import LaunchError, detect, read_launcher
from rayfree.launch.placement import place
from tests.support.paths import PYTHONPATH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_node_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("n1,n[3-4],login", ["n1", "n3", "n4", "login"]),
        ("node-[9-11]", ["node-9", "node-10", "node-11"]),
        ("x[008-010]", ["x008", "x009", "x010"]),
        ("single", ["single"]),
    ],
)
def test_slurm_host_lists_expand_as_scontrol_does(text, hosts) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[4-2]", ""])
def test_a_broken_host_list_is_named(text) -> None:
    with pytest.raises(HostlistError, match="host list"):
        expand_hostlist(text)


STEP = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "localhost,n[1-3]",
    "SLURM_STEP_NODELIST": "localhost,n[1-3]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}


def test_slurm_step_places_the_node_by_its_node_id() -> None:
    launch = read_launcher("auto", STEP)
    assert launch is not None and launch.launcher == "slurm"
    assert (launch.nnodes, launch.node_rank, launch.master_addr) == (4, 2, "127.0.0.1")
    assert launch.hosts == ["localhost", "n1", "n2", "n3"]
    assert launch.sources["node_rank"] == "SLURM_NODEID=2"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"SLURM_STEP_ID": None, "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "0"},
            "SLURM_STEP_ID is not: this is the batch script's shell of a job on 4 nodes",
        ),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x4)"}, r"SLURM_STEP_TASKS_PER_NODE=2\(x4\): rayfree runs one task per node"),
        ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1: rayfree runs one task per node"),
        ({"SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES=3 but SLURM_STEP_NODELIST"),
        ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is outside the step's 4 node"),
        ({"SLURMD_NODENAME": "n3"}, "SLURM_NODEID=2 but SLURMD_NODENAME=n3 is host 3"),
        (
            {
                "SLURM_STEP_NODELIST": "nosuchhost-rayfree-test.invalid,n1",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_NODEID": "1",
            },
            "cannot resolve",
        ),
    ],
)
def test_slurm_variables_that_cannot_place_a_node_are_refused(change, message) -> None:
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(LaunchError, match=message):
        read_launcher("auto", env)


def test_the_batch_shell_of_a_one_node_job_is_node_0() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    launch = read_launcher("slurm", env)
    assert launch is not None and (launch.nnodes, launch.node_rank) == (1, 0)


LWS = {"LWS_LEADER_ADDRESS": "localhost", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "1", "LWS_NAME": "vllm"}
TORCHRUN = {
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
SKY = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_NODES": "2"}


@pytest.mark.parametrize(
    "env, want",
    [
        (LWS, ("lws", 3, 1, "127.0.0.1", "LWS_WORKER_INDEX=1")),
        (TORCHRUN, ("torchrun", 2, 1, "127.0.0.1", "GROUP_RANK=1")),
        (SKY, ("skypilot", 2, 1, "10.0.0.5", "SKYPILOT_NODE_RANK=1")),
        ({**STEP, **TORCHRUN}, ("torchrun", 2, 1, "127.0.0.1", "GROUP_RANK=1")),  # torchrun inside srun: innermost
    ],
)
def test_each_launcher_places_the_node(env, want) -> None:
    launch = read_launcher("auto", env)
    assert launch is not None
    assert (launch.launcher, launch.nnodes, launch.node_rank, launch.master_addr, launch.sources["node_rank"]) == want


@pytest.mark.parametrize(
    "env, message",
    [
        ({**LWS, "LWS_WORKER_INDEX": "3"}, "LWS_WORKER_INDEX=3 is outside LWS_GROUP_SIZE=3"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE=2: rayfree runs one process per node"),
        ({**TORCHRUN, "GROUP_RANK": "x"}, "GROUP_RANK='x' is not a whole number"),
        ({**SKY, "SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES=3 but SKYPILOT_NODE_IPS lists 2"),
    ],
)
def test_each_launchers_own_contradictions_are_refused(env, message) -> None:
    with pytest.raises(LaunchError, match=message):
        read_launcher("auto", env)


def test_none_reads_nothing_and_a_named_launcher_must_be_there() -> None:
    assert read_launcher("none", STEP) is None
    assert detect({}) is None and read_launcher("auto", {}) is None
    with pytest.raises(LaunchError, match="--launcher lws: LWS_LEADER_ADDRESS is not set"):
        read_launcher("lws", STEP)
    with pytest.raises(LaunchError, match="--launcher 'pbs': use one of auto, none"):
        read_launcher("pbs", STEP)


def test_a_flag_that_disagrees_with_the_launcher_is_refused_naming_both() -> None:
    with pytest.raises(LaunchError, match=r"flag --node-rank says node_rank=0 but slurm's SLURM_NODEID=2 says 2"):
        place(parse("--node-rank", "0"), STEP)
    with pytest.raises(LaunchError, match="RAYFREE_NNODES says nnodes=2 but lws's LWS_GROUP_SIZE=3 says 3"):
        place(parse(), {**LWS, "RAYFREE_NNODES": "2"})
    agreed = place(parse("--node-rank", "2"), STEP)
    assert agreed.sources["node_rank"] == "flag --node-rank (agrees with SLURM_NODEID=2)"
    assert place(parse("--node-rank", "0", "--launcher", "none"), STEP).launch is None


def test_torchruns_own_port_is_left_to_torchrun() -> None:
    p = place(parse(), TORCHRUN)
    assert p.values["master_port"] == "29501" and "past its own MASTER_PORT=29500" in p.sources["master_port"]
    with pytest.raises(LaunchError, match="port 29500 is torchrun's own"):
        place(parse("--master-port", "29500"), TORCHRUN)
    with pytest.raises(LaunchError, match="port 29500 is torchrun's own"):
        place(parse("--master-port", "29499"), TORCHRUN)  # its heartbeat port would be 29500
    assert place(parse("--master-port", "29600"), TORCHRUN).values["master_port"] == "29600"


def test_under_a_launcher_one_command_serves_every_node() -> None:
    argv = ("--worker", "a:B", "--entry", "a:f", "--insecure", "--tp", "3")
    follower = plan(parse(*argv), env={**LWS, "RAYFREE_INSECURE": "1"})
    assert follower.entry is None and follower.config.parallel.node_rank == 1
    leader = plan(parse(*argv), env={**LWS, "LWS_WORKER_INDEX": "0", "RAYFREE_INSECURE": "1"})
    assert leader.entry == "a:f" and leader.config.parallel.nnodes == 3
    with pytest.raises(NodeUsageError, match="cannot be --headless"):
        plan(parse(*argv, "--headless"), env={**LWS, "LWS_WORKER_INDEX": "0", "RAYFREE_INSECURE": "1"})


def test_dry_run_prints_the_placement_and_its_sources() -> None:
    env = {**os.environ, **STEP, "SLURM_NODEID": "0", "RAYFREE_INSECURE": "1", "PYTHONPATH": PYTHONPATH}
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", "node", "--dry-run", "--worker", "a:B", "--entry", "a:f", "--tp", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "launcher slurm" in r.stdout
    assert "node_rank   = 0  (slurm: SLURM_NODEID=0)" in r.stdout
    assert "master_addr = 127.0.0.1  (slurm: SLURM_STEP_NODELIST=localhost,n[1-3] (first host localhost" in r.stdout
    assert "node 0 of 4: leader, runs a:f; ranks [0]" in r.stdout


def test_a_refused_placement_is_one_line_and_exit_2() -> None:
    env = {**os.environ, **STEP, "RAYFREE_INSECURE": "1", "PYTHONPATH": PYTHONPATH}
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", "node", "--worker", "a:B", "--node-rank", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "flag --node-rank says node_rank=1 but slurm's SLURM_NODEID=2 says 2" in r.stderr


def test_the_doctor_prints_the_placement_and_refuses_what_disagrees() -> None:
    env = {**os.environ, **STEP, "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost"}
    env["PYTHONPATH"] = PYTHONPATH
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", "doctor", "--quick"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "placement (launcher slurm):" in r.stdout and "node_rank   = 0  (slurm: SLURM_NODEID=0)" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", "doctor", "--quick", "--node-rank", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "flag --node-rank says node_rank=1 but slurm's SLURM_NODEID=0" in r.stdout, r.stdout


def test_entry_takes_a_script_as_torchrun_does(tmp_path) -> None:
    (tmp_path / "helper.py").write_text("CODE = 3\n")
    (tmp_path / "driver.py").write_text(
        "from helper import CODE\n\n\ndef main(ex):\n"
        "    print('ECHO', ex.collective_rpc('echo', args=(5,)), flush=True)\n    return CODE\n"
    )
    argv = ["node", "--worker", "tests.support.sample_workers:EchoWorker", "--entry", f"{tmp_path}/driver.py:main"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RAYFREE_MASTER_PORT": "0"}
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", *argv], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 3 and "ECHO [5]" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "rayfree.cli", *argv[:-1], "nowhere.py:main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.strip().endswith(f"no file {tmp_path}/nowhere.py"), r.stderr
