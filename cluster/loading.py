"""Where a cluster configuration comes from: defaults, then a TOML/JSON file, then RAYFREE_* environment
variables, then command-line flags, later ones winning (`load_config`); the flags themselves
(`add_config_arguments`). The configuration's fields and checks are config.py's."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from rayfree.cluster.config import (
    _CLUSTER_FIELDS,
    _PARALLEL_FIELDS,
    ENV_PREFIX,
    ClusterConfig,
    ConfigError,
    ParallelConfig,
    _read_file,
)

__all__ = ["load_config", "add_config_arguments"]


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
    if t is str:
        return text
    if t is bool:  # the spellings environment variables use
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
    try:
        return msgspec.json.decode(text.strip().lower() if t is bool else text)
    except msgspec.DecodeError:
        raise ConfigError(
            f"{ENV_PREFIX}{name.upper()} / --{name.replace('_', '-')}={text!r}: not a valid {getattr(t, '__name__', t)}"
        ) from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (strings, typed on load) and --config FILE."""
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file with the cluster configuration")
    for name in sorted(_PARALLEL_FIELDS | _CLUSTER_FIELDS):
        flags = ["--" + name.replace("_", "-")] + ([_SHORT[name]] if name in _SHORT else [])
        parser.add_argument(
            *flags,
            dest=name,
            metavar="V",
            default=None,
            help=argparse.SUPPRESS
            if name not in _SHORT and name not in ("nnodes", "node_rank", "master_addr", "master_port")
            else None,
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
    path = getattr(args, "config", None) or file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        raw = _read_file(path)
        raw.pop("node", None)  # `rayfree node`'s own options (worker, entry, ...): read by executor/node.py
        par = dict(raw.pop("parallel", {}) or {})
        data.update(par)
        data.update(raw)
    for name in _PARALLEL_FIELDS | _CLUSTER_FIELDS:
        if ENV_PREFIX + name.upper() in env:
            data[name] = _parse_value(name, env[ENV_PREFIX + name.upper()])
    for name in _PARALLEL_FIELDS | _CLUSTER_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            data[name] = _parse_value(name, v)
    return ClusterConfig.from_dict(data).validate(check_local_master=check_local_master)
