"""What an executor's start-up needs around its worker group: where the workers meet, the checks made before
anything is spawned, callbacks that do not keep the executor alive, and the shutdown's steps.

Plain functions of the configuration; the order of start-up, and what a failure in it means, stay in
multiproc.py.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from rayfree.cluster.config import ClusterConfig, ConfigError
from rayfree.transport import get_open_port
from rayfree.transport.net import port_holder
from rayfree.transport.secure.policy import require_secret
from rayfree.worker.proc import check_worker_path, declared_runs_on

from .errors import WorkerStartupError

__all__ = [
    "init_method",
    "preflight",
    "check_master_port",
    "MasterPortInUse",
    "startup_cause",
    "weak_callback",
    "teardown_step",
]

logger = logging.getLogger("rayfree.executor")


def init_method(config: ClusterConfig) -> str:
    """Where the workers join torch.distributed (tcp://host:port): one world for every replica and node."""
    par = config.parallel
    if par.nnodes > 1 or par.data_parallel_size > 1:
        return f"tcp://{par.master_addr}:{par.master_port or 29500}"
    return f"tcp://127.0.0.1:{get_open_port('127.0.0.1')}"


def preflight(config: ClusterConfig, worker_cls: type | str) -> ClusterConfig:
    """Refuse, before any worker starts, what would fail in every worker: a wrong class path (one error here, not
    one traceback per worker), a cluster of several nodes without a secret, a device the class cannot run on.
    Returns `config` with the device the worker class declares (`with_declared_device`)."""
    if isinstance(worker_cls, str):
        try:
            check_worker_path(worker_cls)
        except ConfigError as e:
            raise WorkerStartupError(f"{e} (refused before starting any worker)") from None
    if config.parallel.nnodes > 1:
        require_secret(f"a cluster of {config.parallel.nnodes} nodes")
    check_master_port(config)
    return with_declared_device(config, worker_cls)


def with_declared_device(config: ClusterConfig, worker_cls: type | str) -> ClusterConfig:
    """`config` with the device the worker class declares (`WorkerBase.runs_on`) where device=auto; a device
    setting that contradicts the class is refused in one line."""
    runs_on = declared_runs_on(worker_cls)
    if runs_on is None or runs_on == config.device:
        return config
    if runs_on not in ("cpu", "cuda"):
        raise ConfigError(f"the worker class declares runs_on={runs_on!r}: use 'cpu' or 'cuda'")
    if config.device != "auto":
        raise ConfigError(
            f"device={config.device!r} but the worker class runs on {runs_on!r} only (its runs_on): "
            f"leave device at auto, or set it to {runs_on}"
        )
    return msgspec.structs.replace(config, device=runs_on)


class MasterPortInUse(ConfigError):
    """Node 0's master port is held by another process: its rendezvous cannot start there."""


def check_master_port(config: ClusterConfig) -> None:
    """On the node that hosts the world's rendezvous (node 0 of a cluster of several nodes or DP replicas):
    refuse a master port another process holds, at once, rather than wait for the join's timeout."""
    par = config.parallel
    if par.node_rank != 0 or (par.nnodes == 1 and par.data_parallel_size == 1):
        return
    port = par.master_port or 29500
    why = port_holder(port, par.master_addr)
    if why is not None:
        raise MasterPortInUse(
            f"master_port {port} on node 0 is in use by another process ({why}); start every node with a free "
            f"port (--master-port / RAYFREE_MASTER_PORT) or stop the process that holds {port}"
        )


#: see startup_cause
STARTUP_VERDICT_SLACK_S = 1.5


def startup_cause(e: BaseException, failure: Callable[[], Exception | None], liveness: Any) -> Exception | None:
    """Why start-up really failed, when `e` is the fallout: the executor's own recorded failure, or a node
    the heartbeats found lost. A rank's rendezvous or handshake that broke because another node went away
    waits (bounded) for the heartbeats' verdict first: that node, or the leader's own failure."""
    from .errors import LeaderLost, NodeLost
    from .peers import await_verdict

    if isinstance(e, KeyboardInterrupt):
        return None
    if failure() is None and isinstance(e, Exception):
        # slack: the other node may be the one whose rank failed first; its own start-up holds a consequence for
        # CONSEQUENCE_HOLD_S and stops its ranks before its goodbye, on a machine as loaded as this one
        await_verdict(liveness, type(e).__name__, str(e), timeouts=False, slack=STARTUP_VERDICT_SLACK_S)
    lost = getattr(liveness, "failure", None)
    return failure() or (lost if isinstance(lost, (NodeLost, LeaderLost)) else None)


def weak_callback(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound) for a thread or an object the executor owns, without that keeping the executor alive
    (None once the executor is gone)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        m = ref()
        return None if m is None else m(*args)

    return call


def teardown_step(what: str, fn: Callable[..., None], *args: Any) -> None:
    """One step of a shutdown: one that raised is logged and the teardown goes on (torch elastic's "abandoning
    and continuing"), so no later step's processes, sockets or segments are left behind."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - see above
        logger.exception("shutdown: %s raised; continuing the teardown", what)
