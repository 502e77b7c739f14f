"""Who watches whom (cluster/watch.py): node 0's quick links are O(replicas + fanout), not O(nodes), and a watcher
is always a node of its child's own failure domain (its loss costs nothing its child's loss would not)."""

from __future__ import annotations

import pytest

from rayfree.cluster.config import ParallelConfig
from rayfree.cluster.heartbeat import HeartbeatServer
from rayfree.cluster.heartbeat_messages import Beat, WatchBy, WatchLost, _encode
from rayfree.cluster.watch import watchers
from rayfree.transport import get_open_port
from rayfree.transport.zmq.sockets import make_dealer
from tests.cluster.test_heartbeats import _beats_until
from tests.support.waits import wait_until


def _par(nnodes: int, tp: int, dp: int = 1, coupling: str = "auto") -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, nnodes=nnodes, replica_coupling=coupling)


@pytest.mark.parametrize(
    ("par", "fanout", "expected"),
    [
        (_par(4, 4), 8, {1: 0, 2: 0, 3: 0}),
        (_par(4, 4), 0, {1: 0, 2: 0, 3: 0}),
        (_par(6, 6), 2, {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}),
        (_par(4, 2, dp=2), 8, {1: 0, 2: 0, 3: 2}),  # (replica 1's first node, 2, watches node 3)
        (_par(4, 2, dp=2, coupling="coupled"), 8, {1: 0, 2: 0, 3: 2}),
        (_par(4, 2, dp=2, coupling="one-world"), 8, {1: 0, 2: 0, 3: 0}),  # (one failure domain: node 0's)
        (_par(2, 1, dp=4), 8, {1: 0}),  # (two replicas per node: each node leads its own)
        (_par(3, 1, dp=3), 8, {1: 0, 2: 0}),
    ],
)
def test_each_node_is_watched_by_a_node_of_its_own_failure_domain(par, fanout, expected) -> None:
    assert watchers(par, fanout) == expected


@pytest.mark.parametrize(("par", "quick"), [(_par(256, 256), 8), (_par(256, 8, dp=32), 31 + 7), (_par(1024, 1024), 8)])
def test_node_0_holds_the_quick_links_of_the_replicas_first_nodes_and_of_its_fanout_only(par, quick) -> None:
    tree = watchers(par, 8)
    assert sum(w == 0 for w in tree.values()) == quick
    assert max(sum(w == k for w in tree.values()) for k in range(par.nnodes)) <= 31 + 7
    assert all(w < k for k, w in tree.items())  # (a heap: no cycle, every node reaches node 0)


@pytest.mark.timeout(60)
def test_node_0_tells_a_child_where_its_watcher_is_and_takes_a_loss_only_from_that_watcher(caplog) -> None:
    """Node 0's side (real sockets, raw followers): node 1 beats where it watches, node 2 that node 1 watches it;
    node 2 is told where (WatchBy). Word of node 1's loss from node 2, which does not watch it, is dropped; word of
    node 2's loss from node 1 loses node 2 at once, naming the watcher, in a cluster whose own bound is 30 s."""
    port = get_open_port("127.0.0.1")
    lost: list[tuple[int, str]] = []
    server = HeartbeatServer(
        "127.0.0.1", port, {1: [1], 2: [2]}, 0.05, 30.0, lambda n, r, ip, why: lost.append((n, why))
    )
    server.start()
    one, two = make_dealer(f"tcp://127.0.0.1:{port}"), make_dealer(f"tcp://127.0.0.1:{port}")
    at = "tcp://10.0.0.2:41234"
    try:
        _beats_until(one, Beat, Beat(1, [1], "10.0.0.2", 101, 1, watch=at))
        told = _beats_until(two, WatchBy, Beat(2, [2], "10.0.0.3", 102, 1, watcher=1))
        assert told == WatchBy(at), told
        server.arm()
        dropped = server.dropped
        two.send(_encode(WatchLost(1, "not its watcher")))
        wait_until(lambda: server.dropped > dropped, 20, "node 0 dropping word of a loss from a non-watcher")
        assert not lost and "does not watch it" in caplog.text, (lost, caplog.text)
        one.send(_encode(WatchLost(2, "its link to it dropped")))
        wait_until(lambda: bool(lost), 20, "node 0 losing node 2 on its watcher's word")
        assert lost == [(2, "its watcher (node 1): its link to it dropped")], lost
    finally:
        one.close(linger=0)
        two.close(linger=0)
        server.close(timeout=10)
