"""`rayfree node` takes every option from flags, the environment or a config file, in that order."""

from __future__ import annotations

import argparse
import os

import pytest

from rayfree.cli.node_options import NodeUsageError, add_node_arguments, plan, port_option


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_node_arguments(p)
    return p.parse_args(list(argv))


def test_a_config_file_can_hold_the_whole_node(tmp_path) -> None:
    f = tmp_path / "node1.toml"
    f.write_text(
        'nnodes = 2\nnode_rank = 1\nmaster_addr = "10.0.0.1"\n[parallel]\ntensor_parallel_size = 2\n'
        '[node]\nworker = "rayfree.cli.toy_engine:ToyWorker"\nheadless = true\nworker_kwargs = {seed = 7}\n'
    )
    config, worker, kwargs, entry, _ = plan(parse("--config", str(f)), env={})
    assert (config.parallel.node_rank, config.parallel.tensor_parallel_size) == (1, 2)
    assert worker == "rayfree.cli.toy_engine:ToyWorker" and kwargs == {"seed": 7} and entry is None


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path) -> None:
    f = tmp_path / "n.json"
    f.write_text('{"node": {"worker": "from.file:W", "entry": "from.file:main"}}')
    env = {"RAYFREE_WORKER": "from.env:W"}
    _, worker, _, entry, _ = plan(parse("--config", str(f)), env=env)
    assert (worker, entry) == ("from.env:W", "from.file:main")
    _, worker, _, _, _ = plan(parse("--config", str(f), "--worker", "from.flag:W"), env=env)
    assert worker == "from.flag:W"


@pytest.mark.parametrize(
    "argv, env, message",
    [
        ((), {}, "give the worker class"),
        (("--worker", "a:B"), {}, "node 0 leads its replica and runs the engine: give --entry"),
        (("--worker", "a:B", "--entry", "a:f", "--headless"), {}, "cannot be --headless"),
        (
            ("--worker", "a:B", "--entry", "a:f", "--node-rank", "1", "--nnodes", "2", "--tp", "2"),
            {},
            r"only its first node \(0\) runs the entry point",
        ),
        (("--worker", "a:B", "--entry", "a:f", "--worker-kwargs", "[1]"), {}, "must be a JSON object"),
        # DP=2 over 2 nodes: each node holds a whole replica, so node 1 leads replica 1
        (
            ("--worker", "a:B", "--nnodes", "2", "--dp", "2", "--node-rank", "1"),
            {},
            "node 1 leads DP replica 1 and runs the engine",
        ),
        (
            ("--worker", "a:B", "--nnodes", "2", "--dp", "2", "--node-rank", "1", "--headless"),
            {},
            "leads DP replica 1, so it cannot be --headless .with this many nodes per replica, every node leads one",
        ),
        # DP=2 over 4 nodes: node 3 follows node 2, the leader of replica 1
        (
            ("--worker", "a:B", "--entry", "a:f", "--nnodes", "4", "--dp", "2", "--tp", "2", "--node-rank", "3"),
            {},
            r"follower of DP replica 1: only its first node \(2\) runs the entry point",
        ),
        (
            ("--worker", "a:B", "--nnodes", "4", "--dp", "2", "--tp", "2", "--node-rank", "2", "--headless"),
            {},
            r"node_rank=2 leads DP replica 1, so it cannot be --headless: its followers are node\(s\) \[3\]",
        ),
    ],
)
def test_each_unworkable_node_is_refused_with_the_fix(argv, env, message) -> None:
    with pytest.raises(NodeUsageError, match=message):
        plan(parse(*argv), env=env)


def test_an_unknown_node_key_in_the_file_is_named(tmp_path) -> None:
    f = tmp_path / "n.toml"
    f.write_text('[node]\nworkr = "a:B"\n')
    with pytest.raises(NodeUsageError, match="workr"):
        plan(parse("--config", str(f)), env={})


@pytest.mark.parametrize(
    "argv, env, want",
    [
        ((), {}, None),
        (("--metrics-port", "9400"), {}, 9400),
        ((), {"RAYFREE_METRICS_PORT": "9401"}, 9401),
        (("--metrics-port", "9402"), {"RAYFREE_METRICS_PORT": "9401"}, 9402),
    ],
)
def test_the_metrics_port_comes_from_the_flag_or_the_environment(argv, env, want) -> None:
    assert port_option(parse(*argv), "metrics_port", env=env) == want


@pytest.mark.parametrize("value", ["http", "0", "70000"])
def test_a_metrics_port_that_is_not_a_port_is_refused(value) -> None:
    with pytest.raises(NodeUsageError, match=f"--metrics-port '{value}' is not a TCP port"):
        port_option(parse("--metrics-port", value), "metrics_port", env={})


@pytest.mark.timeout(120)
def test_every_setting_the_docs_give_is_in_help_and_in_dry_run() -> None:
    """Each cluster field the docs name (as --flag or RAYFREE_<FIELD>) is listed by `rayfree node --help` and
    printed by --dry-run: an operator who read of it can find it, and see the value a node will use."""
    import glob
    import re
    import subprocess
    import sys

    from rayfree.cluster import loading

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    docs = "".join(open(p).read() for p in glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    named = [
        n for n in sorted(loading._PARALLEL_FIELDS | loading._CLUSTER_FIELDS)
        if re.search(rf"(--{n.replace('_', '-')}|RAYFREE_{n.upper()})(?![\w-])", docs)
    ]  # fmt: skip
    assert "replica_coupling" in named and "shared_arguments" in named, named

    def node(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "rayfree.cli", "node", *args], capture_output=True, text=True,
                           timeout=60, cwd=root, env={**os.environ, "RAYFREE_INSECURE": "1"})  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout

    help_text = node("--help")
    plan = node("--dry-run", "--dp", "2", "--replica-coupling", "coupled", "--worker", "x.y:Z", "--entry", "x.y:f")
    for n in named:
        assert re.search(rf"--{n.replace('_', '-')}(?![\w-])", help_text), f"--{n.replace('_', '-')} not in --help"
        assert re.search(rf"^  {n} +=", plan, re.M), f"{n} not in --dry-run:\n{plan}"
    assert re.search(r"^  replica_coupling += coupled$", plan, re.M), plan
