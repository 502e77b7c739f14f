"""What each launcher tells a node about its place: read from the variables the launcher itself sets.

One reader per launcher, each returning a `Launch`: the node count, this node's
rank and node 0's address, and for each the variable it came from. A reader
refuses (LaunchError, one line naming the variables) what would place nodes
wrongly: Slurm's batch shell instead of a step (every node would read
SLURM_NODEID=0 there), several tasks per node, torchrun with several
processes per node, values that contradict each other.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping

import msgspec

from .hostlist import HostlistError, expand_hostlist

__all__ = ["Launch", "LaunchError", "READERS", "detect", "read_launcher"]


class LaunchError(ValueError):
    """The launcher's variables cannot place this node; the message names them and what they said."""


class Launch(msgspec.Struct, kw_only=True):
    """A launcher's answer: this node's place, and where each value came from ("SLURM_NODEID=1")."""

    launcher: str
    nnodes: int
    node_rank: int
    master_addr: str
    sources: dict[str, str]
    #: every node's host, node 0 first, when the launcher lists them (Slurm, SkyPilot)
    hosts: list[str] = []
    #: ports the launcher itself uses on node 0 (torchrun's store): rayfree must not take them
    reserved_ports: list[int] = []


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{launcher}: {name}={raw!r} is not a whole number") from None


def _resolve(host: str, what: str) -> str:
    """A host name as an IPv4 address (every node must reach node 0 by it)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise LaunchError(f"{what}: cannot resolve {host!r} to an address here ({e}); give --master-addr") from None


def _tasks_per_node(text: str) -> list[int]:
    """Slurm's `2(x3),1` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"slurm: tasks per node {text!r} is not Slurm's N(xM),... form")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm(env: Mapping[str, str]) -> Launch:
    job = env["SLURM_JOB_ID"]
    if "SLURM_STEP_ID" not in env:
        n = _int(env, "SLURM_JOB_NUM_NODES", "slurm") if "SLURM_JOB_NUM_NODES" in env else 1
        if n > 1:
            raise LaunchError(
                f"slurm: SLURM_JOB_ID={job} is set but SLURM_STEP_ID is not: this is the batch script's shell of "
                f"a job on {n} nodes (SLURM_JOB_NUM_NODES={n}), where SLURM_NODEID is 0 everywhere; start rayfree "
                f"inside one step, one task per node: srun --ntasks-per-node=1 rayfree node ..."
            )
    nodelist_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    if nodelist_var not in env:
        raise LaunchError(f"slurm: SLURM_JOB_ID={job} is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST")
    try:
        hosts = expand_hostlist(env[nodelist_var])
    except HostlistError as e:
        raise LaunchError(f"slurm: {nodelist_var}: {e}") from None
    count_var = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_JOB_NUM_NODES"
    nnodes = _int(env, count_var, "slurm") if count_var in env else len(hosts)
    if nnodes != len(hosts):
        raise LaunchError(
            f"slurm: {count_var}={nnodes} but {nodelist_var}={env[nodelist_var]!r} names {len(hosts)} host(s)"
        )
    local = _int(env, "SLURM_LOCALID", "slurm") if "SLURM_LOCALID" in env else 0
    per_var = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_NTASKS_PER_NODE"
    per = _tasks_per_node(env[per_var]) if per_var in env else [1]
    if local > 0 or max(per) > 1:
        said = f"{per_var}={env[per_var]}" if max(per) > 1 else f"SLURM_LOCALID={local}"
        raise LaunchError(
            f"slurm: {said}: rayfree runs one task per node (it starts the node's workers itself); "
            f"use srun --ntasks-per-node=1"
        )
    rank = _int(env, "SLURM_NODEID", "slurm") if "SLURM_NODEID" in env else 0
    if not 0 <= rank < nnodes:
        raise LaunchError(f"slurm: SLURM_NODEID={rank} is outside the step's {nnodes} node(s) ({nodelist_var})")
    me = env.get("SLURMD_NODENAME")
    if me and me in hosts and hosts.index(me) != rank:
        raise LaunchError(
            f"slurm: SLURM_NODEID={rank} but SLURMD_NODENAME={me} is host {hosts.index(me)} of {nodelist_var}: "
            f"was SLURM_NODEID set by hand or expanded in the batch shell?"
        )
    master = _resolve(hosts[0], f"slurm: the first host of {nodelist_var}")
    return Launch(
        launcher="slurm",
        nnodes=nnodes,
        node_rank=rank,
        master_addr=master,
        hosts=hosts,
        sources={
            "nnodes": f"{count_var}={nnodes}" if count_var in env else f"{nodelist_var} ({nnodes} hosts)",
            "node_rank": f"SLURM_NODEID={rank}",
            "master_addr": f"{nodelist_var}={env[nodelist_var]} (first host {hosts[0]} = {master})",
        },
    )


def lws(env: Mapping[str, str]) -> Launch:
    size = _int(env, "LWS_GROUP_SIZE", "lws")
    index = _int(env, "LWS_WORKER_INDEX", "lws")
    if size < 1 or not 0 <= index < size:
        raise LaunchError(f"lws: LWS_WORKER_INDEX={index} is outside LWS_GROUP_SIZE={size}")
    leader = env["LWS_LEADER_ADDRESS"]
    master = _resolve(leader, "lws: LWS_LEADER_ADDRESS")
    return Launch(
        launcher="lws",
        nnodes=size,
        node_rank=index,
        master_addr=master,
        sources={
            "nnodes": f"LWS_GROUP_SIZE={size}",
            "node_rank": f"LWS_WORKER_INDEX={index}",
            "master_addr": f"LWS_LEADER_ADDRESS={leader}" + (f" (= {master})" if master != leader else ""),
        },
    )


def torchrun(env: Mapping[str, str]) -> Launch:
    local = _int(env, "LOCAL_WORLD_SIZE", "torchrun") if "LOCAL_WORLD_SIZE" in env else 1
    if local > 1 or (_int(env, "LOCAL_RANK", "torchrun") if "LOCAL_RANK" in env else 0) > 0:
        raise LaunchError(
            f"torchrun: LOCAL_WORLD_SIZE={local}: rayfree runs one process per node (it starts the node's "
            f"workers itself); use torchrun --nproc-per-node 1"
        )
    rank = _int(env, "GROUP_RANK", "torchrun")
    count_var = "GROUP_WORLD_SIZE" if "GROUP_WORLD_SIZE" in env else "WORLD_SIZE"
    nnodes = _int(env, count_var, "torchrun")
    if not 0 <= rank < nnodes:
        raise LaunchError(f"torchrun: GROUP_RANK={rank} is outside {count_var}={nnodes}")
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        raise LaunchError("torchrun: GROUP_RANK is set but MASTER_ADDR is not")
    master = _resolve(addr, "torchrun: MASTER_ADDR")
    port = _int(env, "MASTER_PORT", "torchrun") if "MASTER_PORT" in env else None
    return Launch(
        launcher="torchrun",
        nnodes=nnodes,
        node_rank=rank,
        master_addr=master,
        reserved_ports=[port] if port else [],
        sources={
            "nnodes": f"{count_var}={nnodes}",
            "node_rank": f"GROUP_RANK={rank}",
            "master_addr": f"MASTER_ADDR={addr}" + (f" (= {master})" if master != addr else ""),
        },
    )


def skypilot(env: Mapping[str, str]) -> Launch:
    ips = [h.strip() for h in env.get("SKYPILOT_NODE_IPS", "").split() if h.strip()]
    rank = _int(env, "SKYPILOT_NODE_RANK", "skypilot")
    nnodes = _int(env, "SKYPILOT_NUM_NODES", "skypilot") if "SKYPILOT_NUM_NODES" in env else len(ips)
    if not ips:
        raise LaunchError("skypilot: SKYPILOT_NODE_RANK is set but SKYPILOT_NODE_IPS is empty")
    if len(ips) != nnodes:
        raise LaunchError(f"skypilot: SKYPILOT_NUM_NODES={nnodes} but SKYPILOT_NODE_IPS lists {len(ips)} address(es)")
    if not 0 <= rank < nnodes:
        raise LaunchError(f"skypilot: SKYPILOT_NODE_RANK={rank} is outside SKYPILOT_NUM_NODES={nnodes}")
    return Launch(
        launcher="skypilot",
        nnodes=nnodes,
        node_rank=rank,
        master_addr=ips[0],
        hosts=ips,
        sources={
            "nnodes": f"SKYPILOT_NUM_NODES={nnodes}" if "SKYPILOT_NUM_NODES" in env else "SKYPILOT_NODE_IPS",
            "node_rank": f"SKYPILOT_NODE_RANK={rank}",
            "master_addr": f"SKYPILOT_NODE_IPS (head {ips[0]})",
        },
    )


#: each launcher, the variable that says it started us, and its reader; auto takes the innermost first
#: (torchrun may run inside a Slurm step or a SkyPilot task)
READERS: dict[str, tuple[str, Callable[[Mapping[str, str]], Launch]]] = {
    "torchrun": ("GROUP_RANK", torchrun),
    "skypilot": ("SKYPILOT_NODE_RANK", skypilot),
    "lws": ("LWS_LEADER_ADDRESS", lws),
    "slurm": ("SLURM_JOB_ID", slurm),
}
CHOICES = ["auto", "none", *READERS]


def detect(env: Mapping[str, str]) -> str | None:
    """The launcher whose variables are set (innermost first), or None."""
    return next((name for name, (var, _) in READERS.items() if var in env), None)


def read_launcher(name: str, env: Mapping[str, str]) -> Launch | None:
    """`--launcher NAME`'s answer: auto detects, none reads nothing; a named launcher whose variables are
    missing is refused."""
    if name not in CHOICES:
        raise LaunchError(f"--launcher {name!r}: use one of {', '.join(CHOICES)}")
    if name == "none":
        return None
    if name == "auto":
        found = detect(env)
        if found is None:
            return None
        name = found
    var, reader = READERS[name]
    if var not in env:
        raise LaunchError(f"--launcher {name}: {var} is not set, so this process was not started by {name}")
    return reader(env)
