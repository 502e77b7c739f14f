"""A partition that splits the replicas' leaders in two, on simulated nodes: one authority, each side serving its
own. Node 0 decides every loss and admission, and a node that serves on without it decides nothing for the
cluster (docs/architecture.md, "Failure domains"), so the side without node 0 admits nothing, and two sides never
admit under one epoch.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from rayfree.cluster.simulate import SimulatedCluster
from tests.cluster.test_dp import start
from tests.cluster.test_multinode import DETECT, HB_TIMEOUT, SLACK, assert_nothing_left, needs_root
from tests.executor.test_observe import _status
from tests.support.nodes import Nodes

pytestmark = needs_root

ENTRY = "tests.support.multinode_entry:steps_while_a_replica_is_lost"


@pytest.mark.timeout(300)
def test_a_partition_between_the_replicas_leaders_leaves_one_authority_and_each_side_serves_its_own(tmp_path) -> None:
    """DP=4 x TP=1 on four nodes, every replica stepping; the network split between nodes {0, 1} and {2, 3}.
    Node 0's side: node 0 finds nodes 2 and 3 lost, and replicas 0 and 1 hear replicas 2 and 3 lost. The other
    side: nodes 2 and 3 find node 0 lost, hear replica 0 lost (replica 1, across the cut, is not theirs to judge),
    and serve on deciding nothing (node 2 answers `rayfree status --ask` for itself). Every replica takes 20 more
    checked steps with no failed call, each side within the link's bound; nothing is admitted on either side;
    healed, the sides do not merge, and every node exits 0."""
    hold = tmp_path / "hold"
    with SimulatedCluster(4) as sim:
        nodes = Nodes(sim, **DETECT)
        procs = start(nodes, 4, 4, 1, ENTRY, RF_HOLD=str(hold))
        for k in range(4):
            procs[k].expect(r"^STEPPING:", 180)
        t_cut = time.monotonic()
        sim.partition([0, 1], [2, 3])
        served = {k: procs[k].result("RESULT", 60) for k in range(4)}
        desk = _status(sim, 3, nodes, "--json", "--ask", sim.nodes[2].ip)
        hold.touch()
        sim.heal()
        codes = {k: procs[k].wait(60) for k in range(4)}
        texts = {k: p.text() for k, p in procs.items()}
        assert_nothing_left(sim, procs.values())
    for k, r in served.items():
        why = f"node {k}: {r}\n{texts[k][-4000:]}"
        assert r["outcome"] == "served" and r["after"] == r["equal"] == 20, why  # no call failed
        first, state, _why, t = r["seen"][0]
        assert state == "lost" and first in ((2, 3) if k < 2 else (0,)), why
        assert t - t_cut < HB_TIMEOUT + SLACK, f"node {k} heard of replica {first}'s loss after {t - t_cut:.2f}s"
        assert r["states"][str(k)][0] == "serving", why
        print(f"\nthe partition: node {k} heard replica {first} lost after {t - t_cut:.2f}s and served on")
    for k in (2, 3):
        assert {j: st for j, (st, _w) in served[k]["states"].items()} == {"0": "lost", "1": "serving", "2": "serving",
                                                                          "3": "serving"}, served[k]  # fmt: skip
        assert f"node {k}: node 0 was lost (" in texts[k] and f"this node's replica(s) [{k}] serve on" in texts[k]
    assert all(f"DP replica {j} was lost" in texts[0] for j in (2, 3)), texts[0][-4000:]
    for k in range(4):
        assert not re.search(r"\) is admitted|rejoins in epoch", texts[k]), texts[k][-4000:]
        assert "Traceback" not in texts[k], texts[k][-4000:]
    assert desk[0] == 0, desk
    st = json.loads(desk[1])
    assert st["answered_by"] == 2 and [n["node"] for n in st["nodes"]] == [2], st
    assert {r["replica"]: r["state"] for r in st["replicas"]} == {0: "lost", 1: "serving", 2: "serving", 3: "serving"}
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, (codes, {k: t[-2000:] for k, t in texts.items()})
