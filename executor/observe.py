"""What the executor records about its calls, for `rayfree status`, the stall reports and the metrics.

Kept cheap enough for the engine's step (a few attribute stores per call):
the calls in flight and their start, and each rank's last reply; the
latency histogram per method (one `bisect` more) only once someone reads
it (`histograms`, set when a node serves metrics). The reader is another thread
(the stall watch, a status query, a metrics scrape); it sees a racy but
consistent-enough snapshot, which is all a report needs.

The stall watch (vLLM users' most reported multi-node complaint is "No
available shared memory broadcast block found in 60 seconds", which names
no rank) looks at the oldest call every second: after `stall_report_s` it
logs which ranks the call waits for, which local ranks have not read it
from the ring, and what their processes are doing; after `stall_dump_s` it
has those local ranks dump their Python stacks into the log.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from bisect import bisect_left
from typing import Any

from rayfree.procs import proc_state
from rayfree.supervisor import supervisor

from .view import ReplicaView

__all__ = ["RpcRecorder", "StallWatch", "LATENCY_BOUNDS"]

logger = logging.getLogger("rayfree.executor")

_perf = time.perf_counter

#: upper bounds (seconds) of the latency histogram's buckets; the last bucket is +Inf
LATENCY_BOUNDS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Histogram:
    """Counts per bucket (not cumulative), their sum and count."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.sum += seconds


class Call:
    """One call in flight: its method, start, the ranks it waits for and the replies read so far (the pipe's
    reader of a call is one of these)."""

    __slots__ = ("name", "t0", "ranks", "got")

    def __init__(self, name: str, ranks: list[int]) -> None:
        self.name = name
        self.t0 = _perf()
        self.ranks = ranks
        self.got: dict[int, Any] = {}  # ranks drop out of `waiting` as their replies are read


class RpcRecorder:
    """The executor's record of its calls."""

    def __init__(self, world_size: int, histograms: bool = False) -> None:
        #: record each call's latency (metrics); off, a call costs two clock reads and a few stores
        self.histograms = histograms
        #: the call being waited for in place (at most one: calls take turns), and the pending futures' calls
        self.current: Call | None = None
        self.calls: list[Call] = []
        self.last_reply: list[float] = [0.0] * world_size
        self.hist: dict[str, Histogram] = {}
        self.failures = 0

    def _observe(self, name: str, seconds: float) -> None:
        h = self.hist.get(name)
        if h is None:
            h = self.hist[name] = Histogram()
        h.observe(seconds)

    def end(self, call: Call, ok: bool) -> None:
        t = _perf()
        if self.current is call:
            self.current = None
        else:
            try:
                self.calls.remove(call)
            except ValueError:
                return
        for r in call.got:
            self.last_reply[r] = t
        if not ok:
            self.failures += 1
        elif self.histograms:
            self._observe(call.name, t - call.t0)

    def in_flight(self) -> list[tuple[str, float, list[int], float]]:
        """(method, age in seconds, ranks whose replies are still awaited, its start), oldest first."""
        now = _perf()
        calls = [c for c in (self.current, *self.calls) if c is not None]
        out = [(c.name, now - c.t0, [r for r in c.ranks if r not in c.got], c.t0) for c in calls]
        return sorted(out, key=lambda x: -x[1])

    def since_last_reply(self) -> list[float | None]:
        now = _perf()
        return [None if t == 0.0 else now - t for t in self.last_reply]


class StallWatch:
    """A thread that reports calls waiting longer than `report_s` (see the module docstring)."""

    def __init__(self, ex: ReplicaView, report_s: float, dump_s: float | None) -> None:
        self._ex = weakref.ref(ex)  # the watch must not keep its executor alive
        self.report_s = report_s
        self.dump_s = dump_s
        self._stop = threading.Event()
        self._reported: dict[tuple[str, float], float] = {}  # (method, start) -> age at its last report
        self._dumped: set[tuple[str, float]] = set()

    def start(self) -> StallWatch:
        supervisor().start("RayfreeStallWatch", self._run, stop=self.stop)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(1.0, self.report_s / 2)
        while not self._stop.wait(tick):
            ex = self._ex()
            if ex is None or ex.stopped:
                return
            try:
                self._look(ex)
            except Exception:  # noqa: BLE001 - a report must never take the executor down
                logger.debug("stall watch: could not look", exc_info=True)
            del ex  # not held while waiting for the next tick

    def _look(self, ex: ReplicaView) -> None:
        snap = ex.rpc_snapshot()
        calls = snap.calls if snap is not None else []
        if not calls:
            self._reported.clear()
            return
        name, age, waiting, start = calls[0]
        if age < self.report_s:
            return
        key = (name, start)
        last = self._reported.get(key)
        if last is not None and age - last < self.report_s:
            return
        self._reported = {key: age}
        assert snap is not None
        behind = {r: n for r, n in (snap.ring.get("behind") or {}).items() if n}
        local = {w.rank: w for w in ex.workers}  # ranks within the replica, as the calls name them
        suspects = sorted(set(waiting) | set(behind))
        seen_relays: set[int] = set()
        parts = [f"RPC {name} has waited {age:.0f}s for the reply of rank(s) {waiting}"]
        if behind:
            parts.append(
                "rank(s) "
                + ", ".join(f"{r} ({n} message(s))" for r, n in sorted(behind.items()))
                + " have not read the broadcast ring"
            )
        relays = ex.relays_seen() if any(r not in local for r in suspects) else {}
        sent = (snap.ring.get("bytes") or {}).get("tcp", 0)
        for r in suspects:
            w = local.get(r)
            if w is None:
                node = ex.parallel_config.cluster_node_of(r, ex.dp_rank)
                parts.append(f"rank {r} is on node {node}: see that node's log")
                for rs in relays.get(node, []):
                    if rs.replica == ex.dp_rank and node not in seen_relays:
                        seen_relays.add(node)
                        parts.append(_relay_behind(node, rs, sent))
            else:
                parts.append(f"rank {r} (pid {w.proc.pid}, rayfree::{w.title}) is {proc_state(w.proc.pid)}")
        logger.warning("%s", "; ".join(parts))
        if self.dump_s is not None and age >= self.dump_s and key not in self._dumped:
            self._dumped.add(key)
            stuck = [local[r] for r in suspects if r in local]
            if stuck:
                logger.warning(
                    "RPC %s still waits after %.0fs (stall_dump_s=%.0f): dumping the Python stacks of "
                    "rank(s) %s (a stopped process prints its stack when it resumes)",
                    name,
                    age,
                    self.dump_s,
                    [w.rank for w in stuck],
                )
                ex.dump_stacks([w.rank for w in stuck])


def _relay_behind(node: int, rs: Any, sent: int) -> str:
    """What node `node`'s relay said in its last heartbeat, against the bytes node 0 has broadcast."""
    lag = sent - rs.relayed_bytes
    ring = max(rs.ring_behind.values(), default=0)
    return (
        f"node {node}'s relay has written {rs.relayed} message(s) into its ring, "
        + (f"{lag} byte(s) behind what node 0 sent" if lag > 0 else "none behind node 0")
        + " (as of its last heartbeat)"
        + (f", and a rank there is {ring} chunk(s) behind on that ring" if ring else "")
    )
