"""`rayfree node --metrics-port`: Prometheus metrics, read at scrape time from what the node records anyway.

prometheus_client is an optional extra (`pip install rayfree[metrics]`);
nothing on the call path touches it: a collector turns the executors'
records (executor/observe.py), their broadcast queues' counters and the
heartbeats into metric families when Prometheus asks. The endpoint is plain
HTTP and read-only: counts and timings, no payloads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rayfree.executor.observe import LATENCY_BOUNDS

if TYPE_CHECKING:
    from rayfree.executor.liveness import NodeLiveness

__all__ = ["serve_metrics", "MetricsUnavailable"]

logger = logging.getLogger("rayfree.node")


class MetricsUnavailable(RuntimeError):
    """--metrics-port was given but prometheus_client is not installed."""


class _Collector:
    def __init__(self, liveness: NodeLiveness) -> None:
        self.liveness = liveness

    def describe(self) -> list:
        return []  # no registration-time collect (the executors may not exist yet)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        lv = self.liveness
        node = str(lv.node)
        lat = HistogramMetricFamily(
            "rayfree_rpc_latency_seconds",
            "collective_rpc latency, send to last reply",
            labels=["node", "replica", "method"],
        )
        inflight = GaugeMetricFamily(
            "rayfree_rpc_in_flight", "calls sent whose replies are not all read", labels=["node", "replica"]
        )
        oldest = GaugeMetricFamily(
            "rayfree_rpc_oldest_in_flight_seconds", "age of the oldest call in flight", labels=["node", "replica"]
        )
        failures = CounterMetricFamily(
            "rayfree_rpc_failures", "calls that failed (raised, timed out, cut short)", labels=["node", "replica"]
        )
        sent = CounterMetricFamily(
            "rayfree_broadcast_bytes", "bytes broadcast to the workers, by path", labels=["node", "replica", "path"]
        )
        occupied = GaugeMetricFamily(
            "rayfree_ring_occupied_chunks", "broadcast ring chunks not yet free", labels=["node", "replica"]
        )
        chunks = GaugeMetricFamily("rayfree_ring_chunks", "broadcast ring size in chunks", labels=["node", "replica"])
        behind = GaugeMetricFamily(
            "rayfree_ring_reader_behind_chunks",
            "chunks a local reader has not read",
            labels=["node", "replica", "rank"],
        )
        workers = GaugeMetricFamily(
            "rayfree_workers_alive", "worker processes of this node that are alive", labels=["node"]
        )
        relayed = CounterMetricFamily(
            "rayfree_relay_bytes",
            "a follower's relay: bytes written into its node's ring (in) and passed on to its child nodes (out)",
            labels=["node", "replica", "direction"],
        )
        alive = 0
        for ex in lv.executors():
            rep = str(ex.dp_rank)
            alive += sum(1 for w in ex.workers if w.proc.is_alive())
            if not ex.is_leader:
                r = ex.relay_status()
                if r:
                    relayed.add_metric([node, rep, "in"], r["relayed_bytes"])
                    relayed.add_metric([node, rep, "out"], r["forwarded_bytes"])
                    if r.get("chunks"):
                        occupied.add_metric([node, rep], r["occupied"])
                        chunks.add_metric([node, rep], r["chunks"])
                        first = ex.parallel_config.global_start_rank
                        for rank, n in r["behind"].items():
                            behind.add_metric([node, rep, str(first + rank)], n)
                continue
            snap = ex.rpc_snapshot()
            if snap is None:
                continue
            for method, (counts, total) in snap.latency.items():
                buckets, acc = [], 0
                for bound, c in zip([*map(str, LATENCY_BOUNDS), "+Inf"], counts):
                    acc += c
                    buckets.append((bound, acc))
                lat.add_metric([node, rep, method], buckets, total)
            calls = snap.calls
            inflight.add_metric([node, rep], len(calls))
            oldest.add_metric([node, rep], calls[0][1] if calls else 0.0)
            failures.add_metric([node, rep], snap.failures)
            st = snap.ring
            for path, n in (st.get("bytes") or {}).items():
                sent.add_metric([node, rep, path], n)
            if st.get("chunks"):
                occupied.add_metric([node, rep], st["occupied"])
                chunks.add_metric([node, rep], st["chunks"])
                for rank, n in st["behind"].items():
                    behind.add_metric([node, rep, str(rank)], n)
        workers.add_metric([node], alive)
        yield from (lat, inflight, oldest, failures, sent, relayed, occupied, chunks, behind, workers)
        yield from self._heartbeats(node)

    def _replicas(self, node: str) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = self.liveness.replica_epochs
        labels = ["node", "replica"]
        serving = GaugeMetricFamily("rayfree_replica_serving", "1 while a DP replica serves, else 0", labels=labels)
        epoch = GaugeMetricFamily(
            "rayfree_replica_epoch", "a DP replica's incarnation: 0, then +1 per rejoin", labels=labels
        )
        losses = CounterMetricFamily("rayfree_replica_losses", "times a DP replica was lost", labels=labels)
        rejoins = CounterMetricFamily("rayfree_replica_rejoins", "times a lost DP replica rejoined", labels=labels)
        for k, st in r.states().items():
            serving.add_metric([node, str(k)], 1.0 if st.state == "serving" else 0.0)
            epoch.add_metric([node, str(k)], st.epoch)
            losses.add_metric([node, str(k)], r.losses.get(k, 0))
            rejoins.add_metric([node, str(k)], r.rejoins.get(k, 0))
        roster = r.roster
        widths = GaugeMetricFamily(
            "rayfree_dp_width", "DP replicas: asked for (`rayfree scale`), and taking calls", labels=["node", "kind"]
        )
        widths.add_metric([node, "requested"], roster.requested)
        widths.add_metric([node, "serving"], roster.effective)
        member = GaugeMetricFamily("rayfree_membership_epoch", "one more at each change of the replicas that serve",
                                   labels=["node"])  # fmt: skip
        member.add_metric([node], roster.epoch)
        yield from (serving, epoch, losses, rejoins, widths, member)

    def _heartbeats(self, node: str) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

        lv = self.liveness
        failed = GaugeMetricFamily("rayfree_cluster_failed", "1 once this node's cluster has failed", labels=["node"])
        failed.add_metric([node], 1.0 if lv.failure is not None else 0.0)
        yield failed
        if lv.par.data_parallel_size > 1:  # each DP replica as this node knows it (node 0 knows every loss)
            yield from self._replicas(node)
        b = lv.beater
        if b is not None and lv.node != 0:  # a follower: its beats' round trips to node 0
            last = GaugeMetricFamily(
                "rayfree_heartbeat_last_round_trip_seconds", "the last heartbeat round trip to node 0", labels=["node"]
            )
            last.add_metric([node], b.rtt_s or 0.0)
            rtt = SummaryMetricFamily(
                "rayfree_heartbeat_round_trip_seconds", "heartbeat round trips to node 0", labels=["node"]
            )
            rtt.add_metric([node], b.rtt_count, b.rtt_sum)
            yield from (last, rtt)
        elif b is not None:  # node 0: every follower's last beat
            age = GaugeMetricFamily(
                "rayfree_heartbeat_age_seconds", "seconds since each node's last heartbeat", labels=["node", "peer"]
            )
            lost = GaugeMetricFamily("rayfree_node_lost", "1 for a node node 0 counts as lost", labels=["node", "peer"])
            for peer, _ip, _ranks, a, gone, _st in b.peer_views():
                if a is not None:
                    age.add_metric([node, str(peer)], a)
                lost.add_metric([node, str(peer)], 1.0 if gone else 0.0)
            yield from (age, lost)


def serve_metrics(port: int, liveness: NodeLiveness, addr: str = "0.0.0.0") -> Any:
    """Serve /metrics on addr:port from a daemon thread; returns the server (its `shutdown()` stops it)."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        raise MetricsUnavailable("--metrics-port needs prometheus_client: pip install 'rayfree[metrics]'") from None
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from .http import Served

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scraped every few seconds: quiet
            return

    liveness.histograms = True  # before the executors start: every call is counted
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(liveness))
    server = make_server(addr, port, make_wsgi_app(registry), handler_class=Quiet)
    logger.info("metrics for Prometheus at http://%s:%d/metrics", addr, port)
    return Served(server, "RayfreeMetrics").start()
