"""The cluster's shape and timeouts: `ParallelConfig` inside `ClusterConfig`.

Field names are the ones engines know from vLLM. Ranks are laid out [DP][PP][PCP][TP] (TP fastest), as vLLM
does: in one DP replica a stage's TP ranks are consecutive, node k holds ranks k*local_world_size onward. Every
validation error names the field and says how to fix it. Values come from defaults, then a TOML/JSON file, then
RAYFREE_* environment variables, then command-line flags, later ones winning (loading.py's `load_config`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from rayfree.transport.net import is_local_address, local_addresses

from .devices import DeviceError, check_settings

__all__ = ["ParallelConfig", "ClusterConfig", "ConfigError", "require_config", "ENV_PREFIX", "COUPLINGS"]
#: how DP replicas can be tied (`replica_coupling`)
COUPLINGS = ("independent", "coupled", "one-world", "auto")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix (no traceback need go with it)."""

    says_all = True


class ParallelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the model is split and where its ranks run."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    #: Ranks per node; None: the inner-DP world divided evenly over its nodes.
    local_world_size: int | None = None
    #: The DP replica an executor runs; None: this node's first (set per executor when a node runs several).
    data_parallel_rank: int | None = None
    #: "independent" (a world and failure domain each: a lost replica fails alone, rejoins), "coupled" (as independent,
    #: plus DP/EP groups across the replicas that serve: they shrink at a loss, grow at a rejoin), "one-world" (one
    #: world: one failing stops all), "auto" (coupled with expert parallelism, else independent); operations.md
    replica_coupling: str = "auto"
    #: which incarnation of its DP replica an executor runs: 0, then one more at each rejoin (node 0 says; not set)
    replica_epoch: int = 0
    # -- derived ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Ranks in one DP replica (the inner-DP world): TP x PP x PCP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data_parallel_size

    @property
    def coupled(self) -> bool:  # replicas of their own, with DP/EP groups across those that serve (shrink, grow)?
        c = self.replica_coupling
        return self.data_parallel_size > 1 and (c == "coupled" or (c == "auto" and self.enable_expert_parallel))

    @property
    def one_world(self) -> bool:  # do the DP replicas share one world, and fail together?
        return self.data_parallel_size > 1 and self.replica_coupling == "one-world"

    @property
    def nnodes_within_dp(self) -> int:
        """Nodes that one DP replica spans (the nodes are shared evenly by the replicas)."""
        return max(1, self.nnodes // self.data_parallel_size)

    @property
    def replicas_per_node(self) -> int:
        """DP replicas one node holds: 1 when a replica spans nodes, else DP / nnodes."""
        return max(1, self.data_parallel_size // self.nnodes)

    def replicas_of_node(self, node: int) -> list[int]:
        """The DP ranks whose ranks run on node `node`."""
        if self.data_parallel_size >= self.nnodes:
            k = self.replicas_per_node
            return list(range(node * k, (node + 1) * k))
        return [node // self.nnodes_within_dp]

    def nodes_of_replica(self, dp_rank: int) -> list[int]:
        """The nodes replica `dp_rank` runs on; its leader is the first."""
        if self.data_parallel_size >= self.nnodes:
            return [dp_rank // self.replicas_per_node]
        n = self.nnodes_within_dp
        return list(range(dp_rank * n, (dp_rank + 1) * n))

    def leads(self, node: int) -> bool:
        """Is node `node` the first of its replica (it runs the executor that broadcasts, and the entry)?"""
        return node % self.nnodes_within_dp == 0

    @property
    def node_replicas(self) -> list[int]:
        """The DP ranks this node runs."""
        return self.replicas_of_node(self.node_rank)

    @property
    def dp_rank(self) -> int:
        """The DP replica of this executor (`data_parallel_rank`, else this node's first)."""
        return self.node_replicas[0] if self.data_parallel_rank is None else self.data_parallel_rank

    def global_rank(self, rank: int, dp_rank: int | None = None) -> int:
        """Rank `rank` of replica `dp_rank` (default: this one) in the world across DP (`[DP][PP][PCP][TP]`)."""
        return (self.dp_rank if dp_rank is None else dp_rank) * self.world_size + rank

    def node_ranks(self, node: int) -> list[int]:
        """The world ranks (across DP) that run on node `node`."""
        out = []
        for r in self.replicas_of_node(node):
            within = self.nodes_of_replica(r).index(node)
            out += [self.global_rank(within * self.local_ranks + i, r) for i in range(self.local_ranks)]
        return out

    @property
    def node_rank_within_dp(self) -> int:
        return self.node_rank % self.nnodes_within_dp

    @property
    def local_ranks(self) -> int:
        """Ranks on this node (`local_world_size`, or the even split)."""
        return self.local_world_size or self.world_size // self.nnodes_within_dp

    @property
    def global_start_rank(self) -> int:
        """The first rank (within the DP replica) that runs on this node."""
        return self.node_rank_within_dp * self.local_ranks

    @property
    def output_rank(self) -> int:
        """The rank whose output the engine reads: first TP rank of the last PP stage."""
        return self.world_size - self.tensor_parallel_size * self.prefill_context_parallel_size

    def is_driver_rank(self, rank: int) -> bool:
        return rank % self.tensor_parallel_size == 0

    @property
    def driver_ranks(self) -> list[int]:
        return list(range(0, self.world_size, self.tensor_parallel_size))

    def node_of(self, rank: int) -> int:
        """Node (within the DP replica) that runs `rank`."""
        return rank // self.local_ranks

    def cluster_node_of(self, rank: int, dp_rank: int | None = None) -> int:
        """The node (its node_rank in the cluster) that runs rank `rank` of replica `dp_rank`."""
        return self.nodes_of_replica(self.dp_rank if dp_rank is None else dp_rank)[self.node_of(rank)]

    # -- validation ------------------------------------------------------------

    def validate(self, check_local_master: bool = False) -> ParallelConfig:
        """Raise ConfigError on the first inconsistency; return self."""
        _check_types(self)
        sizes = ("tensor", "pipeline", "prefill_context", "data", "decode_context")
        for name in (*(f"{k}_parallel_size" for k in sizes), "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be a whole number >= 1")
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp:
            raise ConfigError(
                f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}: "
                f"DCP groups are made of TP ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"node_rank={self.node_rank} is out of range for nnodes={self.nnodes}: use 0..{self.nnodes - 1}"
            )
        if self.nnodes > 1 and self.nnodes % self.data_parallel_size and self.data_parallel_size % self.nnodes:
            raise ConfigError(
                f"nnodes={self.nnodes} and data_parallel_size={self.data_parallel_size}: one must "
                f"divide the other, so each DP replica gets whole nodes (or each node whole replicas)"
            )
        per_dp = self.nnodes_within_dp
        if self.world_size % per_dp:
            raise ConfigError(
                f"world size {self.world_size} (tensor x pipeline x prefill-context parallel) is not "
                f"divisible by the {per_dp} node(s) of a DP replica: change nnodes or the parallel "
                f"sizes so every node runs the same number of ranks"
            )
        if self.local_world_size is not None:
            if self.local_world_size < 1 or self.local_world_size * per_dp != self.world_size:
                raise ConfigError(
                    f"local_world_size={self.local_world_size} does not match: {per_dp} node(s) x "
                    f"{self.local_world_size} != world size {self.world_size}; leave it unset or "
                    f"set it to {self.world_size // per_dp}"
                )
        if self.data_parallel_rank is not None and self.data_parallel_rank not in self.node_replicas:
            raise ConfigError(
                f"data_parallel_rank={self.data_parallel_rank} does not run on node {self.node_rank}: "
                f"with nnodes={self.nnodes} and data_parallel_size={self.data_parallel_size} this "
                f"node runs replica(s) {self.node_replicas}; leave it unset"
            )
        if self.replica_coupling not in COUPLINGS:
            raise ConfigError(f"replica_coupling={self.replica_coupling!r}: use {', '.join(COUPLINGS[:-1])} or auto")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"master_port={self.master_port} is not a TCP port: use 1..65535 (0 picks a free one)")
        if not self.master_addr:
            raise ConfigError("master_addr is empty: give node 0's address on the cluster network")
        if check_local_master and self.node_rank == 0 and not is_local_address(self.master_addr):
            raise ConfigError(
                f"master_addr={self.master_addr!r} is not an address of this machine, but this is "
                f"node 0, which hosts the rendezvous: use one of {sorted(local_addresses())}"
            )
        return self


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The parallel layout plus every timeout the cluster uses (seconds)."""

    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    #: joining torch.distributed: how long a rank waits for the others (a late node pulling its image is normal)
    join_timeout_s: float = 900.0
    #: workers becoming ready after spawn (the join and the model load included)
    ready_timeout_s: float = 1800.0
    #: default deadline of an RPC; None waits forever
    rpc_timeout_s: float | None = None
    #: shutdown stages: after closing the death pipes, after SIGTERM (then SIGKILL)
    shutdown_grace_s: float = 4.0
    shutdown_term_s: float = 4.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    #: TCP port of the leader's heartbeat endpoint (on master_addr); None: master_port + 1
    heartbeat_port: int | None = None
    #: treat every rank as on another node (no shared memory between them)
    force_remote: bool = False
    #: how a broadcast reaches other nodes: "relay" (once per node, into its ring, by its node process) or
    #: "flat" (once per remote rank, each subscribed to node 0)
    broadcast: str = "relay"
    #: past this many follower nodes, relays pass the broadcast on as a tree of this fan-out
    relay_fanout: int = 8
    #: workers hand their outputs to a sender thread, so the next step can start at once
    async_scheduling: bool = False
    #: how long a worker or the executor may spin for the next message before it parks (microseconds; the
    #: spin adapts to recent waits up to this cap); None: RAYFREE_SPIN_US
    spin_us: float | None = None
    #: a call (or its send) waiting this long is reported, and again at this interval, naming the ranks it waits for
    stall_report_s: float = 10.0
    #: after this long, the local ranks such a call waits for dump their Python stacks into the log; None: never
    stall_dump_s: float | None = 60.0
    #: methods whose exception on any rank is fatal (peers may be blocked in a collective with that rank)
    collective_methods: list[str] = msgspec.field(
        default_factory=lambda: ["execute_model", "sample_tokens", "compile_or_warm_up_model"]
    )
    #: big tensor arguments as views of the node's ring, not copies: not to change, and one kept holds the ring
    shared_arguments: bool = False
    #: GPU nodes (devices.py, docs/gpu.md): which visible devices the workers use (None: all); CPU binding at
    #: spawn ("none", "auto": the GPU's NUMA node, or NUMA ids by worker); a CUDA_VISIBLE_DEVICES per worker;
    #: one NIC per device (NCCL_IB_HCA)
    device_ids: str | None = None
    numa_bind: str = "none"
    per_rank_visible_devices: bool = False
    gpu_nics: str | None = None
    #: where the workers run: "auto" (a GPU each if the node has enough, else the CPU), "cpu", "cuda" (devices.py)
    device: str = "auto"

    def validate(self, check_local_master: bool = False) -> ClusterConfig:
        """Raise ConfigError on the first wrong or inconsistent value (naming the field and the value); return
        self. The executors call it before anything else runs."""
        if not isinstance(self.parallel, ParallelConfig):
            raise ConfigError(
                f"parallel={self.parallel!r}: must be a rayfree.ParallelConfig, e.g. "
                f"ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2))"
            )
        _check_types(self)
        self.parallel.validate(check_local_master)
        try:
            check_settings(self.numa_bind, self.device_ids, self.gpu_nics, self.device)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        timeouts = ("join_timeout_s", "ready_timeout_s", "shutdown_grace_s", "shutdown_term_s")
        for name in (*timeouts, "heartbeat_interval_s", "heartbeat_timeout_s", "stall_report_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"{name}={v!r}: must be a positive number of seconds")
        if self.spin_us is not None and (not isinstance(self.spin_us, (int, float)) or self.spin_us < 0):
            raise ConfigError(f"spin_us={self.spin_us!r}: must be >= 0 microseconds (0 never spins), or unset")
        if self.stall_dump_s is not None and self.stall_dump_s <= 0:  # (its type: _check_types)
            raise ConfigError(f"stall_dump_s={self.stall_dump_s!r}: must be positive seconds, or unset (never dump)")
        if self.rpc_timeout_s is not None and self.rpc_timeout_s <= 0:
            raise ConfigError(f"rpc_timeout_s={self.rpc_timeout_s!r}: must be positive, or unset to wait forever")
        if self.heartbeat_port is not None and not 1 <= self.heartbeat_port <= 65535:
            raise ConfigError(
                f"heartbeat_port={self.heartbeat_port} is not a TCP port: use 1..65535, or leave it "
                f"unset for master_port + 1"
            )
        if self.heartbeat_port is None and self.parallel.master_port >= 65535:
            raise ConfigError(
                f"master_port={self.parallel.master_port} leaves no room for the heartbeat port "
                f"(master_port + 1): lower master_port or set heartbeat_port"
            )
        if self.broadcast not in ("relay", "flat"):
            raise ConfigError(f"broadcast={self.broadcast!r}: use 'relay' (once per node) or 'flat' (once per rank)")
        if self.relay_fanout < 1:
            raise ConfigError(f"relay_fanout={self.relay_fanout}: a node relays to at least 1 other")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed heartbeat_interval_s="
                f"{self.heartbeat_interval_s}: a node is declared lost after missing several beats"
            )
        return self

    @property
    def heartbeat_endpoint_port(self) -> int:
        """The leader's heartbeat port: `heartbeat_port`, or master_port + 1."""
        return self.heartbeat_port or self.parallel.master_port + 1

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """From a mapping; parallel fields may sit at top level or under "parallel"."""
        data = dict(data)
        par = dict(data.pop("parallel", {}) or {})
        for name in _PARALLEL_FIELDS:
            if name in data:
                par[name] = data.pop(name)
        try:
            return msgspec.convert({**data, "parallel": par}, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"invalid configuration: {e}") from None

    @classmethod
    def from_file(cls, path: str) -> ClusterConfig:
        return cls.from_dict(read_config_file(path))


_WORDS = {  # a field's type, in words
    **{"<class 'int'>": "a whole number", "<class 'float'>": "a number", "<class 'str'>": "a string"},
    **{"<class 'bool'>": "True or False", "float | None": "a number or None", "int | None": "a whole number or None"},
    **{"str | None": "a string or None", "list[str]": "a list of strings"},
}


def _check_types(cfg: msgspec.Struct) -> None:
    """Every field holds a value of its declared type (a Struct's constructor checks nothing): `"2"`, 2.5,
    None or True for a size is refused here, by name, before anything multiplies it."""
    for f in msgspec.structs.fields(cfg):
        if f.name == "parallel":
            continue
        value = getattr(cfg, f.name)
        try:
            msgspec.convert(value, f.type, strict=True)
        except msgspec.ValidationError as e:
            what = _WORDS.get(str(f.type).replace("typing.", ""), str(e).split(", got")[0].replace("Expected ", ""))
            raise ConfigError(f"{f.name}={value!r}: must be {what} ({type(value).__name__} given)") from None


def require_config(config: Any) -> ClusterConfig:
    """`config` if it is a valid ClusterConfig; else TypeError (not one) or ConfigError (a field is wrong)."""
    if not isinstance(config, ClusterConfig):
        hint = " (ClusterConfig.from_dict(...) takes a dict)" if isinstance(config, Mapping) else ""
        raise TypeError(f"config must be a rayfree.ClusterConfig, got {type(config).__name__}{hint}")
    return config.validate()


_PARALLEL_FIELDS = {f for f in ParallelConfig.__struct_fields__}
_CLUSTER_FIELDS = {f for f in ClusterConfig.__struct_fields__} - {"parallel"}
ENV_PREFIX = "RAYFREE_"


def read_config_file(path: str) -> dict[str, Any]:
    """A TOML or JSON config file's tables (ConfigError naming the file if it cannot be read or parsed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    try:
        if path.endswith(".json"):
            loaded: dict[str, Any] = json.loads(raw)
            return loaded
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise ConfigError(
                    f"{path}: reading TOML needs Python >= 3.11 or `pip install tomli`; or use a .json file"
                ) from None
        return tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"config file {path!r} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: {e}"
        ) from None
