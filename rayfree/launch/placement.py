"""A node's place from every source at once: flags, RAYFREE_*, the config file, and the launcher.

The launcher fills in what the operator did not say; where both say something
and they disagree, the node refuses to start with one line naming both (a
node placed twice, differently, is the classic multi-node mistake). Each value
keeps where it came from, for `rayfree node --dry-run` and the doctor.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import msgspec

from rayfree.cluster.config import ENV_PREFIX, ParallelConfig
from rayfree.cluster.loading import resolve

from .launchers import Launch, LaunchError, read_launcher

__all__ = ["Placement", "place", "FIELDS"]

#: what a launcher places; the rest of the configuration is the operator's alone
FIELDS = ("nnodes", "node_rank", "master_addr", "master_port")
_DEFAULTS = {f: str(getattr(ParallelConfig(), f)) for f in FIELDS}


class Placement(msgspec.Struct, kw_only=True):
    """The four placed values (as flag strings), each with its source, and the launcher's answer if any."""

    values: dict[str, str]
    sources: dict[str, str]
    launch: Launch | None = None
    #: values the launcher supplied that no flag, RAYFREE_* or file gave (to be fed to the config as flags)
    filled: dict[str, str] = {}

    def describe(self) -> list[str]:
        """One line per value: `node_rank = 1  (SLURM_NODEID=1)`."""
        width = max(len(f) for f in FIELDS)
        return [f"{f.ljust(width)} = {self.values[f]}  ({self.sources[f]})" for f in FIELDS]


def _explicit(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """field -> (value, source) for what the operator gave: flag, else RAYFREE_*, else the config file."""
    return {f: (str(s.value), s.origin) for f, s in resolve(args, env, (*FIELDS, "heartbeat_port")).items()}


def _same(field: str, a: str, b: str) -> bool:
    if field == "master_addr":
        if a == b:
            return True
        import socket

        try:
            return socket.gethostbyname(a) == socket.gethostbyname(b)
        except OSError:
            return False
    try:
        return int(a) == int(b)
    except ValueError:
        return a == b


def place(args: argparse.Namespace, env: Mapping[str, str], launcher: str | None = None) -> Placement:
    """This node's placement; LaunchError (one line) when sources disagree or the launcher's variables do."""
    name = launcher or getattr(args, "launcher", None) or env.get(ENV_PREFIX + "LAUNCHER") or "auto"
    launch = read_launcher(name.strip().lower(), env)
    given = _explicit(args, env)
    values = {f: given[f][0] if f in given else _DEFAULTS[f] for f in FIELDS}
    sources = {f: given[f][1] if f in given else "default" for f in FIELDS}
    filled: dict[str, str] = {}
    if launch is not None:
        said = {"nnodes": str(launch.nnodes), "node_rank": str(launch.node_rank), "master_addr": launch.master_addr}
        for f, v in said.items():
            if f in given and not _same(f, given[f][0], v):
                hint = f"drop {given[f][1].replace('flag ', '')}" if given[f][1] != "default" else ""
                raise LaunchError(
                    f"{given[f][1]} says {f}={given[f][0]} but {launch.launcher}'s {launch.sources[f]} says {v}: "
                    f"{hint} (rayfree reads {launch.launcher}'s placement), or pass --launcher none to place "
                    f"nodes by flags alone"
                )
            if f not in given:
                values[f], sources[f], filled[f] = v, launch.launcher + ": " + launch.sources[f], v
            else:
                sources[f] += f" (agrees with {launch.sources[f]})"
        _keep_clear(launch, given, values, sources, filled)
    return Placement(values=values, sources=sources, launch=launch, filled=filled)


def _keep_clear(
    launch: Launch,
    given: dict[str, tuple[str, str]],
    values: dict[str, str],
    sources: dict[str, str],
    filled: dict[str, str],
) -> None:
    """rayfree's ports (master_port, the heartbeat port next to it) off the ports the launcher uses."""
    if not launch.reserved_ports:
        return
    reserved = set(launch.reserved_ports)
    port = int(values["master_port"])
    hb = int(given["heartbeat_port"][0]) if "heartbeat_port" in given else port + 1
    taken = reserved & {port, hb}
    if not taken:
        return
    if "master_port" in given or "heartbeat_port" in given:
        which = "master_port" if port in taken else "heartbeat_port"
        src = given[which][1] if which in given else given["master_port"][1] + " (heartbeat = master_port + 1)"
        raise LaunchError(
            f"{src}: port {sorted(taken)[0]} is {launch.launcher}'s own ({launch.launcher} uses it for its store): "
            f"give rayfree other ports, or leave --master-port out and rayfree picks the next free pair"
        )
    new = max(reserved) + 1
    values["master_port"] = filled["master_port"] = str(new)
    sources["master_port"] = f"{launch.launcher}: past its own MASTER_PORT={max(reserved)} (the store it hosts)"
