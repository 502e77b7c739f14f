"""The roster's rules for the width the operator asks for (`rayfree scale`, `scale_replicas`): a scale in drains
the replicas past it, a scale out waits for its new replicas' nodes until its deadline, and one given up goes
back. Node 0 decides and tells the followers the requested width (`tell_width`), so that a follower serving on
without node 0 knows it, and a node 0 started again resumes it (roster.py's `Resume`). Part of the roster:
no I/O, no clock of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ReplicaDrained, ReplicaLost
from .roster_events import Decision, Layout, Scale, Tick, WidthHeard
from .roster_replica import Replica

__all__ = ["WidthRules"]


class WidthRules:
    """The width's part of `Roster` (its state is the roster's; `Roster.handle` calls these)."""

    layout: Layout
    requested: int
    _r: dict[int, Replica]
    _width_before: int | None
    _spent: dict[int, int]

    if TYPE_CHECKING:

        @property
        def effective(self) -> int: ...

        def _drain(self, k: int) -> list[Decision]: ...

    def _on_scale(self, ev: Scale) -> list[Decision]:
        n, lay, was = ev.width, self.layout, self.requested
        if n < 1:
            return [Decision("answer", text="refused: a cluster serves with at least one DP replica; to stop it, "
                                            "stop node 0")]  # fmt: skip
        if lay.one_world:
            return [Decision("answer", text="refused: replicas that share one world (replica_coupling=one-world) "
                                            "cannot change their width at runtime")]  # fmt: skip
        if any(r.phase == "starting" and r.deadline is not None for r in self._r.values()) and n > was:
            return [Decision("answer", text=f"refused: a scale-out to {was} is still waiting for its nodes")]
        if n == was:
            return [Decision("answer", text=f"the requested DP width is {n} already ({self.effective} serving)")]
        out: list[Decision] = []
        self.requested = n
        if n < was:
            for k in sorted(self._r):
                r = self._r[k]
                if k >= n and r.phase == "serving":
                    out += self._drain(k) + [Decision("tell_drain", k)]
                elif k >= n and r.phase in ("starting", "rejoining"):
                    out += self._unwanted(k)
            text = f"DP width {was} -> {n}: replicas {[k for k in sorted(self._r) if k >= n]} drain, then their " \
                   f"nodes exit 0"  # fmt: skip
        else:
            self._width_before = was
            for k in range(n):  # (a replica past those the cluster had starts in epoch 1: it had no first start)
                r = self._r.setdefault(k, Replica("starting", epoch=self._spent.get(k, 0) + 1))
                if r.phase in ("starting", "lost", "drained"):
                    r.deadline = ev.now + ev.wait_s
            want = [k for k in range(was, n)]
            nodes = sorted({x for k in want for x in lay.nodes_of_replica(k)})
            text = f"DP width {was} -> {n}: start node(s) {nodes} for replica(s) {want} with the cluster's command " \
                   f"within {ev.wait_s:.0f}s"  # fmt: skip
        return out + [
            Decision("tell_width", epoch=n),
            Decision("say", epoch=1, text=text),
            Decision("answer", text=text),
        ]

    def _unwanted(self, k: int) -> list[Decision]:
        """Replica k, past a lower width, comes no more: its nodes admitted so far are told, and leave."""
        r = self._r[k]
        out = []
        if r.admitted:
            why = f"the requested DP width went below {k + 1}: DP replica {k} is no longer wanted; this node stops"
            nodes = tuple(sorted(r.admitted))
            out.append(Decision("tell_down", k, nodes=nodes, text=why, cause=ReplicaLost(k, nodes[0], [], why)))
        r.admitted, r.deadline = set(), None
        if r.phase == "starting":
            del self._r[k]
            self._spent[k] = r.epoch  # (its next try starts past it: a node told to leave may still meet)
        else:
            r.phase = "drained" if isinstance(r.cause, ReplicaDrained) else "lost"
        return out

    def _on_tick(self, ev: Tick) -> list[Decision]:
        late = [k for k, r in sorted(self._r.items()) if r.deadline is not None and ev.now >= r.deadline]
        if not late:
            return []
        out: list[Decision] = []
        back = self._width_before if self._width_before is not None else self.requested
        for k in late:
            out += self._unwanted(k) if self._r[k].phase == "starting" else []
            if k in self._r:
                self._r[k].deadline = None
        if all(r.deadline is None for r in self._r.values()):
            self.requested = min(self.requested, max(back, self.effective))
            self._width_before = None
            out.append(Decision("tell_width", epoch=self.requested))
        text = f"the scale-out's replica(s) {late} did not all come in time: the requested width is " \
               f"{self.requested} again, the serving replicas as they were"  # fmt: skip
        out += [Decision("say", epoch=2, text=text)]
        return out

    def _on_widthheard(self, ev: WidthHeard) -> list[Decision]:
        self.requested = ev.requested
        return []
