"""rayfree's cluster layer: ranks, nodes and groups.

config.py      the cluster's shape and timeouts (no torch needed)
group.py       a gloo process group with byte collectives and the two queue builders
parallel_state the process-wide world / TP / PP / DP / PCP / DCP / EP / inner-DP groups
simulate.py    simulated nodes on one machine (network namespaces, private /dev/shm)
join.py        the rendezvous: who is missing, who disagrees on the shape
pg_queues.py   vLLM's create_from_process_group(...) constructors, and the queue class that spells them so
"""

if __name__ != "rayfree.cluster":  # the repository's folder imported as a top-level package: two copies of rayfree
    raise ImportError(
        f"import rayfree.cluster, not {__name__}: this folder installs as rayfree.cluster "
        f"(pip install -e . puts it there)"
    )


from . import pg_queues
from .config import ClusterConfig, ConfigError, ParallelConfig
from .loading import load_config

__all__ = ["ClusterConfig", "ParallelConfig", "ConfigError", "load_config", "pg_queues"]
