"""rayfree's cluster layer: ranks, nodes and groups.

config.py      the cluster's shape and timeouts (no torch needed)
group.py       a gloo process group with byte collectives and the two queue builders
parallel_state the process-wide world / TP / PP / DP / PCP / DCP / EP / inner-DP groups
simulate.py    simulated nodes on one machine (network namespaces, private /dev/shm)
"""

from .config import ClusterConfig, ConfigError, ParallelConfig, load_config

__all__ = ["ClusterConfig", "ParallelConfig", "ConfigError", "load_config"]
