"""Every RAYFREE_* knob in one table: its default, its type and what it is for.

Values are read from the environment when a component is built (`get`), not at
import, so a test or an engine that sets one before building a queue or an
executor is heard. The docs' settings page is generated from `TABLE`.
The cluster's shape and timeouts (RAYFREE_<ClusterConfig field>) are read by
`rayfree.cluster.loading.load_config`, not here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Setting", "TABLE", "get", "is_set", "parse_flag"]


class Setting(NamedTuple):
    name: str
    default: Any  # a value, or a function giving it
    parse: Callable[[str], Any]
    doc: str


def parse_flag(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a yes/no value (use 1 or 0)")


def _str(text: str) -> str:
    return text.strip()


def _cores() -> int:
    return os.cpu_count() or 1


TABLE: dict[str, Setting] = {
    s.name: s
    for s in (
        # transport
        Setting(
            "RAYFREE_SPIN_US",
            200.0,
            float,
            "how long a waiting queue call may spin before it parks, in microseconds (0: always park)",
        ),
        Setting(
            "RAYFREE_YIELD_US",
            None,
            float,
            "a spinner yields its core every this many microseconds (unset: 50, or at every check on a "
            "ring with at least twice as many processes as cores)",
        ),
        Setting(
            "RAYFREE_COPY_THREADS",
            lambda: min(4, _cores()),
            int,
            "threads that copy a big payload into shared memory (unset: min(4, cores); 1: the caller alone)",
        ),
        Setting(
            "RAYFREE_RING_FENCES",
            "auto",
            _str,
            "the ring's payload<->flag fences: auto (only on CPUs that reorder them, not x86) or always",
        ),
        Setting(
            "RAYFREE_POOL_MIN_BYTES",
            1 << 20,
            int,
            "a reader copies buffers at least this big into warm memory from its pool (zero_copy readers: views them "
            "in place)",
        ),
        Setting(
            "RAYFREE_READER_POOL_BYTES",
            128 << 20,
            int,
            "most idle memory a reader's pool keeps for the next big payloads",
        ),
        Setting("RAYFREE_WAIT_LOG_INTERVAL_S", 60.0, float, "a blocked queue call says so in the log this often"),
        Setting(
            "RAYFREE_CLOSE_FLUSH_S",
            5.0,
            float,
            "a closed writer keeps its remote publisher up to this long for readers to confirm CLOSE",
        ),
        Setting(
            "RAYFREE_LINK_TIMEOUT_S",
            0.4,
            float,
            "a heartbeat connection that carries nothing this long is closed by libzmq's own pings (every quarter "
            "of it, in its I/O thread), and its node is lost unless it is back within 0.3 s (0: no link pings)",
        ),
        Setting(
            "RAYFREE_WATCH_FANOUT",
            8,
            int,
            "a node's quick link goes to its watcher, the first node of its replica, which watches this many "
            "nodes, each of those the next as many (their links to node 0 are held to heartbeat_timeout_s), and "
            "tells node 0 of a loss; 0: every node's quick link goes to node 0",
        ),
        Setting(
            "RAYFREE_LINK_GRACE_S",
            10.0,
            float,
            "a remote reader whose TCP connection to the writer dropped raises QueueBroken once it has waited "
            "this long for a message since",
        ),
        Setting(
            "RAYFREE_HEAP_TUNE",
            True,
            parse_flag,
            "1: a process with a remote reader sets glibc's mmap and trim thresholds to 32 and 64 MiB (where glibc's "
            "own rule ends), so what ZeroMQ receives lands in warm memory; 0: glibc's defaults",
        ),
        Setting(
            "RAYFREE_HOST_IP",
            None,
            _str,
            "this node's address for cluster traffic (unset: the interface that routes to master_addr)",
        ),
        Setting(
            "RAYFREE_SECRET_FILE",
            None,
            _str,
            "the cluster secret file (`rayfree keygen`); compose mounts it at /run/secrets/rayfree_secret",
        ),
        Setting("RAYFREE_INSECURE", False, parse_flag, "1: plain TCP without a cluster secret (trusted networks only)"),
        Setting("RAYFREE_HANDLE_MAX_AGE_S", 3600.0, float, "a signed queue handle older than this is refused"),
        # cluster
        Setting(
            "RAYFREE_FORCE_REMOTE",
            False,
            parse_flag,
            "1: treat every other rank as on another node (no shared memory between ranks)",
        ),
        Setting("RAYFREE_CONFIG", None, _str, "a TOML or JSON file with the cluster configuration"),
        # worker and executor
        Setting(
            "RAYFREE_WORKER_MULTIPROC_METHOD", "spawn", _str, "how worker processes start: spawn, fork or forkserver"
        ),
        Setting(
            "RAYFREE_LOCAL_DEVICE",
            None,
            int,
            "set by the node in each worker on a GPU node, not by operators: the worker's device, by index among "
            "those it sees (WorkerBase.device_index)",
        ),
        Setting(
            "RAYFREE_TOPOLOGY_ROOT",
            "/",
            _str,
            "where a node reads its GPUs and NUMA nodes (/proc/driver/nvidia, /sys) from: a test's own tree",
        ),
        Setting("RAYFREE_LOG_LEVEL", "INFO", _str, "log level of rayfree's processes (node, workers)"),
        # `rayfree node`
        Setting("RAYFREE_WORKER", None, _str, "`rayfree node --worker`: the engine's worker class, pkg.mod:Class"),
        Setting("RAYFREE_WORKER_KWARGS", None, _str, "`rayfree node --worker-kwargs`: a JSON object"),
        Setting("RAYFREE_ENTRY", None, _str, "`rayfree node --entry`: node 0's driver, pkg.mod:func"),
        Setting("RAYFREE_HEADLESS", False, parse_flag, "`rayfree node --headless`: a follower node"),
        Setting(
            "RAYFREE_ENTRY_GRACE_S",
            0.5,
            float,
            "`rayfree node`: once the cluster failed (the entry's pending calls raised, its failure callback ran), "
            "how long the entry point has to return before the node interrupts it and exits 1",
        ),
        Setting(
            "RAYFREE_MIN_SERVING_REPLICAS",
            1,
            int,
            "`rayfree node` on node 0, independent DP replicas: /readyz answers 200 while at least this many serve",
        ),
        Setting(
            "RAYFREE_ACROSS_REPLICAS_TIMEOUT_S",
            30.0,
            float,
            "coupled DP replicas: how long a collective across replicas, or their groups' forming, waits for a "
            "member before it fails (a replica lost under it)",
        ),
        Setting(
            "RAYFREE_DRAIN_TIMEOUT_S",
            60.0,
            float,
            "`rayfree drain`: how long a draining replica's calls in flight may take; then they fail (ReplicaDrained)",
        ),
        Setting(
            "RAYFREE_METRICS_PORT", None, _str, "`rayfree node --metrics-port`: serve Prometheus metrics on this port"
        ),
        # the demo's nodes
        Setting(
            "RAYFREE_HEALTH_PORT", None, _str, "`rayfree node --health-port`: serve /livez and /readyz on this port"
        ),
        Setting(
            "RAYFREE_LAUNCHER",
            "auto",
            _str,
            "`rayfree node --launcher`: where node rank, count and master come from (auto, none, slurm, lws, "
            "torchrun, skypilot)",
        ),
        Setting("RAYFREE_DEMO_STEPS", 200, int, "steps the demo's driver runs on a node"),
        Setting("RAYFREE_DEMO_T0", None, float, "when the demo started (time.time()), for its wall-time line"),
        Setting("RAYFREE_DEMO_MARKS", None, str, "rayfree demo --lose-replica: where each leader marks that it steps"),
        Setting("RAYFREE_DEMO_TIMEOUT_S", 300.0, float, "how long the demo's nodes may take before it stops them"),
    )
}


def get(name: str, env: Any = None) -> Any:
    """The setting's value now: the environment's (parsed), else its default.

    A value that does not parse is an error naming the variable, never a silent default.
    """
    s = TABLE[name]
    text = (os.environ if env is None else env).get(name)
    if text is None or (text.strip() == "" and s.parse is not parse_flag):
        return s.default() if callable(s.default) else s.default
    try:
        return s.parse(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r}: {e}; unset it for the default ({s.default!r})") from None


def is_set(name: str, env: Any = None) -> bool:
    return bool(((os.environ if env is None else env).get(name) or "").strip())
