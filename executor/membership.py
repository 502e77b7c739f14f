"""Coupled DP replicas (`replica_coupling="coupled"`): the groups across replicas shrink at a loss and grow at
a rejoin, while every surviving process stays.

Node 0's roster (roster.py) declares each membership: an epoch and the
replicas that serve, at a replica's loss, drain or return; node 0 tells every
follower (`Regroup`). Each node hands it to the executors it leads
(`Membership.want`). An executor forms its ranks' groups again
(`rayfree_regroup`, the worker's hook `on_replicas_changed` included) before
the engine's next call goes out, on the caller's thread under the pipe's lock,
so no call ever runs on groups of another membership; an executor with no call
coming does it at once, from a thread of its own, so every member's ranks meet
to form the groups together.

A step whose collective across replicas met the loss (a rank's error that reads
like a lost peer: the rank drops its groups and stays, worker/proc.py) raises
`ReplicasChanged` once the new membership is declared: the engine runs it again.
If no membership change comes within the heartbeats' bound, the error is the
executor's own failure, as it is with every other coupling.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

from rayfree.cluster.peers import peer_gone
from rayfree.supervisor import supervisor

from .errors import FatalWorkerError, ReplicasChanged

if TYPE_CHECKING:
    from .roles import Node, PolicyExecutor

__all__ = ["Membership", "adopt", "REGROUP"]

logger = logging.getLogger("rayfree.executor")

#: the worker's method that forms its groups across replicas (WorkerBase)
REGROUP = "rayfree_regroup"
#: how long a step that met a loss waits for the membership to change, beyond the heartbeats' bound
_CHANGE_SLACK_S = 1.5


def adopt(lv: Node, at: int, members: list[int]) -> None:
    """Every node (its policy thread): membership epoch `at` is `members`; the executors it leads form it."""
    if at <= lv.membership[0]:
        return
    lv.membership = (at, list(members))
    for ex in lv.executors():
        m = getattr(ex, "membership", None)
        if m is not None and ex.dp_rank in members:
            m.want(at, members)


class Membership:
    """One leading executor's groups across replicas: the membership it must form, and the one its ranks have."""

    def __init__(self, ex: PolicyExecutor) -> None:
        self._ex = weakref.ref(ex)
        lv = ex.liveness
        assert lv is not None  # (coupled replicas: every executor has its node's liveness)
        #: (epoch, members) its ranks formed at start-up: every replica at epoch 0; a rejoined one, none yet
        self.formed: tuple[int, list[int]] | None = lv.membership if ex.parallel_config.replica_epoch == 0 else None
        self.wanted = self.formed
        self.changed = threading.Event()
        self._first = threading.Event()  # (set once a membership is wanted: a rejoined replica waits for it)

    def want(self, at: int, members: list[int]) -> None:
        """The policy thread: form this membership before the next call; at once if no call is under way."""
        self.wanted = (at, list(members))
        self.changed.set()
        self._first.set()
        supervisor().start(f"RayfreeRegroup-{at}", self._now)

    def _now(self) -> None:
        ex = self._ex()
        if ex is None:
            return
        # A replica that rejoins hears its first membership while its executor still starts: its queues are not
        # ready, and a regroup sent now reaches the ranks but its replies cannot be read; formed twice under one
        # epoch, the first groups' pairs then close under the other replicas' ranks. It forms once started.
        until = time.monotonic() + ex.config.ready_timeout_s
        while ex.starting and not (ex.is_failed or ex.stopped) and time.monotonic() < until:
            time.sleep(0.05)
        if ex.pipe is None or ex.stopped or ex.starting:
            return  # (still starting: the first call forms it, `before_call`)
        try:
            with ex.pipe.lock:  # (after a call under way; a call that comes first forms it itself)
                self.before_call()
        except Exception as e:  # noqa: BLE001 - the engine's next call meets it again and raises it
            logger.warning("DP replica %d: the groups across replicas were not formed: %s", ex.dp_rank, e)

    def before_call(self) -> None:
        """Under the pipe's lock, before a call goes out: form the wanted membership if the ranks lack it."""
        ex = self._ex()
        if self.wanted is None and ex is not None:  # a rejoined replica: no call before its first membership
            bound = ex.config.join_timeout_s
            until = time.monotonic() + bound
            while not self._first.wait(0.05) and time.monotonic() < until:
                if ex.is_failed or ex.stopped:
                    return  # (the call meets the failure itself)
            if self.wanted is None:
                raise ReplicasChanged(
                    -1, [], f"DP replica {ex.dp_rank} rejoined but node 0 declared no membership within {bound:.0f}s"
                )
        want = self.wanted
        if want is None or want == self.formed or ex is None or ex.pipe is None:
            return
        self.formed = want  # (first: the call below comes through here too)
        t0 = time.monotonic()
        try:
            ex.pipe.call(REGROUP, ex.config.join_timeout_s, want, None, False, None, None)
        except Exception as e:
            self.formed = None
            raise ReplicasChanged(want[0], want[1], f"its groups could not be formed: {e}") from e
        logger.info(
            "DP replica %d: groups across replicas %s formed (epoch %d) in %.3fs",
            ex.dp_rank, want[1], want[0], time.monotonic() - t0,
        )  # fmt: skip

    def judge(self, error: FatalWorkerError, name: str) -> ReplicasChanged | None:
        """A caller got a rank's collective error: a lost peer's, once a new membership is declared, is
        `ReplicasChanged` (run the step again); None: it is this executor's failure (reported, if no one did)."""
        ex = self._ex()
        if ex is None or not peer_gone(error.error_type, error.message):
            return None
        seen = self.wanted
        lv = ex.liveness
        until = time.monotonic() + (lv.verdict_s() if lv is not None else 0.0) + _CHANGE_SLACK_S
        while time.monotonic() < until and not ex.is_failed:
            if self.wanted != seen or (self.wanted is not None and self.wanted != self.formed):
                at, members = self.wanted  # type: ignore[misc]
                return ReplicasChanged(at, members, f"RPC {name} met a lost DP replica ({error.error_type})")
            self.changed.wait(0.02)
            self.changed.clear()
        if not ex.is_failed and lv is not None:  # no replica was lost: the rank's error is this executor's failure
            lv.policy.report(f"rank {error.rank}", error, ex)
        return None
