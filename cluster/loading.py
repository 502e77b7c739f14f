"""Where a cluster configuration comes from: defaults, then a TOML/JSON file, then RAYFREE_* environment
variables, then command-line flags, later ones winning (`load_config`); the flags themselves
(`add_config_arguments`). The configuration's fields and checks are config.py's.

`resolve` is the one place a value's origin is decided, for the configuration's fields, `rayfree node`'s own
options (the file's [node] table) and a node's placement (rayfree/launch, which adds the launcher's values):
each value comes with where it came from (`--tp`, `RAYFREE_TENSOR_PARALLEL_SIZE`, `config file c.toml`)."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from rayfree.settings import parse_flag

from .config import (
    _CLUSTER_FIELDS,
    _PARALLEL_FIELDS,
    ENV_PREFIX,
    ClusterConfig,
    ConfigError,
    ParallelConfig,
    read_config_file,
)

__all__ = ["load_config", "add_config_arguments", "resolve", "Sourced", "config_path"]


class Sourced(NamedTuple):
    """One value an operator gave, and where: `value` is a flag's or variable's text, or the file's typed value."""

    value: Any
    origin: str

    @property
    def from_file(self) -> bool:
        return self.origin.startswith("config file ")


def config_path(args: argparse.Namespace | None, env: Mapping[str, str], file: str | None = None) -> str | None:
    """The config file in use: --config, else the caller's, else RAYFREE_CONFIG."""
    return getattr(args, "config", None) or file or env.get(ENV_PREFIX + "CONFIG") or None


def resolve(
    args: argparse.Namespace | None,
    env: Mapping[str, str],
    names: Sequence[str] | set[str],
    *,
    table: str | None = None,
    file: str | None = None,
    others: bool = False,
) -> dict[str, Sourced]:
    """What the operator gave for each of `names`: the flag, else RAYFREE_<NAME>, else the config file (its
    top level and [parallel] table, or the named `table`); names nobody gave are absent. With `others`, the
    file's other keys too (the caller refuses those it does not know)."""
    path = config_path(args, env, file)
    found: dict[str, Any] = {}
    if path:
        raw = read_config_file(path)
        if table is not None:
            found = raw.get(table, {})
            if not isinstance(found, dict):
                raise ConfigError(f"{path}: [{table}] must be a table")
        else:
            found = {k: v for k, v in raw.items() if k not in ("node", "parallel")}
            found = {**(raw.get("parallel") or {}), **found}
    out: dict[str, Sourced] = {}
    for name in names:
        v = getattr(args, name, None) if args is not None else None
        if v is not None:
            out[name] = Sourced(v, f"flag --{name.replace('_', '-')}")
        elif ENV_PREFIX + name.upper() in env:
            out[name] = Sourced(env[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper())
        elif name in found:
            out[name] = Sourced(found[name], f"config file {path}")
    if others:
        out.update({k: Sourced(v, f"config file {path}") for k, v in found.items() if k not in out})
    return out


#: short flags for the common fields, as `vllm serve` spells them
_SHORT = {
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--pp",
    "data_parallel_size": "--dp",
    "prefill_context_parallel_size": "--pcp",
    "decode_context_parallel_size": "--dcp",
}


def _field_type(name: str) -> Any:
    cls = ParallelConfig if name in _PARALLEL_FIELDS else ClusterConfig
    return msgspec.structs.fields(cls)[[f.name for f in msgspec.structs.fields(cls)].index(name)].type


def _parse_value(name: str, text: str) -> Any:
    """An environment/flag string for field `name`, typed by msgspec."""
    t = _field_type(name)
    if text.strip().lower() in ("", "none", "null") and "None" in str(t):
        return None
    if t is str or set(typing.get_args(t)) == {str, type(None)}:  # (a string, or one that may be unset)
        return text
    if t is bool and text.strip():  # the spellings environment variables use
        try:
            return parse_flag(text)
        except ValueError:
            pass  # (said below, with the setting's name)
    try:
        return msgspec.json.decode(text.strip().lower() if t is bool else text)
    except msgspec.DecodeError:
        raise ConfigError(
            f"{ENV_PREFIX}{name.upper()} / --{name.replace('_', '-')}={text!r}: not a valid {getattr(t, '__name__', t)}"
        ) from None


#: the fields an operator sets (the docs name each): shown by --help, with what they do, and printed by --dry-run;
#: every other field has its flag too, unlisted
OPERATOR_FIELDS = {
    "tensor_parallel_size": "ranks of a tensor-parallel group",
    "pipeline_parallel_size": "pipeline stages",
    "data_parallel_size": "DP replicas",
    "prefill_context_parallel_size": "prefill context-parallel ranks",
    "decode_context_parallel_size": "decode context-parallel ranks",
    "nnodes": "nodes in the cluster",
    "node_rank": "this node's rank (0: the driver's node)",
    "master_addr": "node 0's address",
    "master_port": "node 0's rendezvous port (the heartbeats use the next one)",
    "device": "where the workers run: auto (a GPU each when the node has enough, else the CPU), cpu or cuda",
    "device_ids": "the GPUs this node's workers use, by index or UUID (default: all it sees)",
    "numa_bind": "bind each worker to its GPU's NUMA node (docs/gpu.md)",
    "replica_coupling": "how DP replicas are tied: independent, coupled, one-world or auto",
    "shared_arguments": "1: local workers read big tensor arguments as views of the node's ring",
    "broadcast": "how calls reach other nodes' workers: relay or direct",
    "force_remote": "1: no shared memory between ranks (every rank as on another node)",
    "gpu_nics": "the RDMA NICs next to each GPU, for NCCL",
    "spin_us": "how long a waiting queue call spins before it parks, in microseconds",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (strings, typed on load) and --config FILE."""
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file with the cluster configuration")
    for name in sorted(_PARALLEL_FIELDS | _CLUSTER_FIELDS):
        flags = ["--" + name.replace("_", "-")] + ([_SHORT[name]] if name in _SHORT else [])
        shown = OPERATOR_FIELDS.get(name)
        parser.add_argument(
            *flags,
            dest=name,
            metavar="V",
            default=None,
            help=argparse.SUPPRESS if shown is None and name not in _SHORT else f"{shown} [RAYFREE_{name.upper()}]",
        )


def load_config(
    args: argparse.Namespace | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | None = None,
    check_local_master: bool = True,
) -> ClusterConfig:
    """Defaults < file < RAYFREE_* environment < flags; validated (node 0 checks master_addr is local)."""
    if args is None or not isinstance(args, argparse.Namespace):
        p = argparse.ArgumentParser(add_help=False)
        add_config_arguments(p)
        args = p.parse_args(list(args or []))
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    # (the file's unknown keys are from_dict's to refuse; its [node] table is `rayfree node`'s own options)
    for name, s in resolve(args, env, sorted(_PARALLEL_FIELDS | _CLUSTER_FIELDS), file=file, others=True).items():
        data[name] = s.value if s.from_file else _parse_value(name, s.value)
    return ClusterConfig.from_dict(data).validate(check_local_master=check_local_master)
