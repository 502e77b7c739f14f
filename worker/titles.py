"""Process titles (`rayfree::Worker_PP1_TP0`): what `ps`, the logs and the executor's errors call a worker."""

from __future__ import annotations

import multiprocessing
import sys

from rayfree.cluster.config import ParallelConfig

__all__ = ["process_name", "title_for", "set_title"]


def process_name(dims: list[tuple[str, int, int]]) -> str:
    """Worker_PP1_TP0: only the dimensions larger than 1, as (tag, size, rank)."""
    return "Worker" + "".join(f"_{tag}{rank}" for tag, size, rank in dims if size > 1)


def title_for(par: ParallelConfig, rank: int) -> str:
    """The title rank `rank` of a DP replica will have, from the layout alone ([DP][PP][PCP][TP], TP fastest)."""
    tp, pcp, pp, dcp = (
        par.tensor_parallel_size,
        par.prefill_context_parallel_size,
        par.pipeline_parallel_size,
        par.decode_context_parallel_size,
    )
    dims = [
        ("DP", par.data_parallel_size, par.dp_rank),
        ("PP", pp, rank // (tp * pcp) % pp),
        ("PCP", pcp, rank // tp % pcp),
        ("TP", tp, rank % tp),
        ("DCP", dcp, rank % dcp),
    ]
    return process_name(dims)


def set_title(enable_ep: bool = False, fallback: str = "Worker", replica: tuple[int, int] = (1, 0)) -> str:
    """Title this process after its place in the parallel groups (once they exist; else `fallback`, say
    `title_for`'s: an engine that builds its own groups) and name its log lines. `replica`: (DP size, this DP
    rank), for independent replicas, whose DP group is the rank alone."""
    ps = sys.modules.get("rayfree.cluster.parallel_state")  # not imported: no groups (and no torch import here)
    name = fallback
    if ps is not None and ps.model_parallel_is_initialized():
        dp = ps.get_dp_group()
        size, at = (dp.world_size, dp.rank_in_group) if dp.world_size > 1 else replica
        groups = [
            ("PP", ps.get_pp_group()),
            ("PCP", ps.get_pcp_group()),
            ("TP", ps.get_tp_group()),
            ("DCP", ps.get_dcp_group()),
        ]
        if enable_ep:
            groups.append(("EP", ps.get_ep_group()))
        name = process_name([("DP", size, at)] + [(tag, g.world_size, g.rank_in_group) for tag, g in groups])
    try:
        import setproctitle

        setproctitle.setproctitle(f"rayfree::{name}")
    except ImportError:  # pragma: no cover - it is a dependency
        pass
    multiprocessing.current_process().name = name  # %(processName)s in every log line
    return name
