"""The membership state machine (rayfree/executor/roster.py) by tables, as etcd's raft package is tested: every
event in every phase a replica can be in, on node 0 and on a follower; then sequences (a rejoin, a superseded
replacement, scale out and in, a scale-out that times out, bad input) and every order of a set of faults. No
I/O, no threads, no clock: the whole module runs in well under a second."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from rayfree.cluster.config import ParallelConfig
from rayfree.executor import roster as R
from rayfree.executor.errors import ReplicaDrained, ReplicaLost

pytestmark = pytest.mark.timeout(30)


def make(node: int, dp: int = 3, coupling: str = "independent") -> R.Roster:
    """A cluster of `dp` replicas, one node each (replica k on node k), as node `node` sees it."""
    return R.Roster(ParallelConfig(data_parallel_size=dp, nnodes=dp, node_rank=node, replica_coupling=coupling))


def lost(k: int, why: str = "killed") -> R.Lost:
    return R.Lost(k, ReplicaLost(k, k, [k], why))


def drained(k: int) -> R.Lost:
    return R.Lost(k, ReplicaDrained(k, k, [k]))


def into(phase: str, node: int) -> tuple[R.Roster, int]:
    """A roster with one replica (its rank returned) in `phase`, reached by the events that lead there."""
    r, k = make(node), 1
    steps: list[R.Event] = {
        "starting": [R.Scale(4, 0.0, 30.0)],
        "serving": [],
        "draining": [R.Drain(1) if node == 0 else R.DrainHeard(1)],
        "drained": [R.Drain(1) if node == 0 else R.DrainHeard(1), drained(1)],
        "lost": [lost(1)],
        "rejoining": [lost(1), R.Admit(1, 500, "s", "s")],
    }[phase]
    if phase == "starting":
        k = 3
    for ev in steps:
        r.handle(ev)
    assert r.phase(k) == phase, (phase, r.phase(k))
    return r, k


EVENTS: dict[str, Callable[[R.Roster, int], R.Event]] = {
    "lost": lambda r, k: lost(k),
    "drain_end": lambda r, k: drained(k),
    "admit": lambda r, k: R.Admit(k, 900, "s", "s"),
    "admit_wrong_shape": lambda r, k: R.Admit(k, 901, "t", "s"),
    "ready": lambda r, k: R.Ready(frozenset(range(5))),
    "back": lambda r, k: R.Back(k, r.epochs()[k] + 1),
    "drain": lambda r, k: R.Drain(k),
    "drain_heard": lambda r, k: R.DrainHeard(k),
    "scale_out": lambda r, k: R.Scale(r.requested + 1, 100.0, 30.0),
    "scale_in": lambda r, k: R.Scale(k, 100.0, 30.0),
    "tick": lambda r, k: R.Tick(1e9),
    "regrouped": lambda r, k: R.Regrouped(r.epoch + 5, (0,)),
    "welcomed": lambda r, k: R.Welcomed(((k, 7),)),
    "resume": lambda r, k: R.Resume(((k, 4),), 2),
    "resume_drained": lambda r, k: R.Resume(((k, 4),), 2, ((k, ReplicaDrained(k, k, [k])),), 2),
    "resume_lost": lambda r, k: R.Resume(((k, 4),), 2, ((k, ReplicaLost(k, k, [k], "killed")),), 5),
    "width_heard": lambda r, k: R.WidthHeard(2),
}

#: node 0: (phase, event) -> the replica's phase after, the decisions' kinds in order, the requested width after
#: (MISUSE: an event node 0 never gets; the roster refuses it and changes nothing)
NODE_0 = [
    ("starting", "lost", "lost", "say, tell_down, announce", 4),
    ("starting", "drain_end", "drained", "say, tell_down, announce", 4),
    ("starting", "admit", "starting", "say, admit", 4),
    ("starting", "admit_wrong_shape", "starting", "say, refuse", 4),
    ("starting", "ready", "starting", "", 4),
    ("starting", "back", "starting", "MISUSE", 4),
    ("starting", "drain", "starting", "answer", 4),
    ("starting", "drain_heard", "starting", "MISUSE", 4),
    ("starting", "scale_out", "starting", "answer", 4),
    ("starting", "scale_in", "absent", "tell_width, say, answer", 3),
    ("starting", "tick", "absent", "tell_width, say", 3),
    ("starting", "regrouped", "starting", "MISUSE", 4),
    ("serving", "lost", "lost", "say, tell_down, announce", 3),
    ("serving", "drain_end", "drained", "say, tell_down, announce", 3),
    ("serving", "admit", "serving", "say, ignore", 3),
    ("serving", "admit_wrong_shape", "serving", "say, refuse", 3),
    ("serving", "ready", "serving", "", 3),
    ("serving", "back", "serving", "MISUSE", 3),
    ("serving", "drain", "draining", "say, announce, tell_drain, answer", 3),
    ("serving", "drain_heard", "serving", "MISUSE", 3),
    ("serving", "scale_out", "serving", "tell_width, say, answer", 4),
    (
        "serving",
        "scale_in",
        "draining",
        "say, announce, tell_drain, say, announce, tell_drain, tell_width, say, answer",
        1,
    ),
    ("serving", "tick", "serving", "", 3),
    ("serving", "regrouped", "serving", "MISUSE", 3),
    ("draining", "lost", "drained", "say, tell_down, announce", 3),
    ("draining", "drain_end", "drained", "say, tell_down, announce", 3),
    ("draining", "admit", "draining", "say, refuse", 3),
    ("draining", "admit_wrong_shape", "draining", "say, refuse", 3),
    ("draining", "ready", "draining", "", 3),
    ("draining", "back", "draining", "MISUSE", 3),
    ("draining", "drain", "draining", "answer", 3),
    ("draining", "drain_heard", "draining", "MISUSE", 3),
    ("draining", "scale_out", "draining", "tell_width, say, answer", 4),
    ("draining", "scale_in", "draining", "say, announce, tell_drain, tell_width, say, answer", 1),
    ("draining", "tick", "draining", "", 3),
    ("draining", "regrouped", "draining", "MISUSE", 3),
    ("drained", "lost", "drained", "say", 3),
    ("drained", "drain_end", "drained", "say", 3),
    ("drained", "admit", "rejoining", "say, admit", 3),
    ("drained", "admit_wrong_shape", "drained", "say, refuse", 3),
    ("drained", "ready", "drained", "", 3),
    ("drained", "back", "drained", "MISUSE", 3),
    ("drained", "drain", "drained", "answer", 3),
    ("drained", "drain_heard", "drained", "MISUSE", 3),
    ("drained", "scale_out", "drained", "tell_width, say, answer", 4),
    ("drained", "scale_in", "drained", "say, announce, tell_drain, tell_width, say, answer", 1),
    ("drained", "tick", "drained", "", 3),
    ("drained", "regrouped", "drained", "MISUSE", 3),
    ("lost", "lost", "lost", "say", 3),
    ("lost", "drain_end", "lost", "say", 3),
    ("lost", "admit", "rejoining", "say, admit", 3),
    ("lost", "admit_wrong_shape", "lost", "say, refuse", 3),
    ("lost", "ready", "lost", "", 3),
    ("lost", "back", "lost", "MISUSE", 3),
    ("lost", "drain", "lost", "answer", 3),
    ("lost", "drain_heard", "lost", "MISUSE", 3),
    ("lost", "scale_out", "lost", "tell_width, say, answer", 4),
    ("lost", "scale_in", "lost", "say, announce, tell_drain, tell_width, say, answer", 1),
    ("lost", "tick", "lost", "", 3),
    ("lost", "regrouped", "lost", "MISUSE", 3),
    ("rejoining", "lost", "rejoining", "say", 3),
    ("rejoining", "drain_end", "rejoining", "say", 3),
    ("rejoining", "admit", "rejoining", "say, admit", 3),
    ("rejoining", "admit_wrong_shape", "rejoining", "say, refuse", 3),
    ("rejoining", "ready", "serving", "say, tell_up, announce", 3),
    ("rejoining", "back", "rejoining", "MISUSE", 3),
    ("rejoining", "drain", "rejoining", "answer", 3),
    ("rejoining", "drain_heard", "rejoining", "MISUSE", 3),
    ("rejoining", "scale_out", "rejoining", "tell_width, say, answer", 4),
    ("rejoining", "scale_in", "lost", "tell_down, say, announce, tell_drain, tell_width, say, answer", 1),
    ("rejoining", "tick", "rejoining", "", 3),
    ("rejoining", "regrouped", "rejoining", "MISUSE", 3),
    ("starting", "welcomed", "starting", "MISUSE", 4),
    ("serving", "welcomed", "serving", "MISUSE", 3),
    ("draining", "welcomed", "draining", "MISUSE", 3),
    ("drained", "welcomed", "drained", "MISUSE", 3),
    ("lost", "welcomed", "lost", "MISUSE", 3),
    ("rejoining", "welcomed", "rejoining", "MISUSE", 3),
    # node 0 started again takes the epochs a follower serving without it knew; no replica's phase changes
    ("starting", "resume", "starting", "say", 4),
    ("serving", "resume", "serving", "say", 3),
    ("draining", "resume", "draining", "say", 3),
    ("drained", "resume", "drained", "say", 3),
    ("lost", "resume", "lost", "say", 3),
    ("rejoining", "resume", "rejoining", "say", 3),
    # ... and the replicas it knew out of service (drained or lost) are so again, at the width it knew
    ("starting", "resume_drained", "drained", "say", 2),
    ("starting", "resume_lost", "lost", "say", 5),
    ("starting", "width_heard", "starting", "MISUSE", 4),
    ("serving", "resume_drained", "drained", "say", 2),
    ("serving", "resume_lost", "lost", "say", 5),
    ("serving", "width_heard", "serving", "MISUSE", 3),
    ("draining", "resume_drained", "drained", "say", 2),
    ("draining", "resume_lost", "lost", "say", 5),
    ("draining", "width_heard", "draining", "MISUSE", 3),
    ("drained", "resume_drained", "drained", "say", 2),
    ("drained", "resume_lost", "lost", "say", 5),
    ("drained", "width_heard", "drained", "MISUSE", 3),
    ("lost", "resume_drained", "drained", "say", 2),
    ("lost", "resume_lost", "lost", "say", 5),
    ("lost", "width_heard", "lost", "MISUSE", 3),
    ("rejoining", "resume_drained", "drained", "say", 2),
    ("rejoining", "resume_lost", "lost", "say", 5),
    ("rejoining", "width_heard", "rejoining", "MISUSE", 3),
]

#: a follower (node 1, running replica 1): the phases it can see (node 0 alone knows "starting" and "rejoining")
FOLLOWER = [
    ("serving", "lost", "lost", "say, stop_replica, announce, node_ends", 3),
    ("serving", "drain_end", "drained", "say, stop_replica, announce, node_ends", 3),
    ("serving", "admit", "serving", "MISUSE", 3),
    ("serving", "admit_wrong_shape", "serving", "MISUSE", 3),
    ("serving", "ready", "serving", "MISUSE", 3),
    ("serving", "back", "serving", "say, announce", 3),
    ("serving", "drain", "serving", "MISUSE", 3),
    ("serving", "drain_heard", "draining", "say, announce, begin_drain", 3),
    ("serving", "scale_out", "serving", "MISUSE", 3),
    ("serving", "scale_in", "serving", "MISUSE", 3),
    ("serving", "tick", "serving", "MISUSE", 3),
    ("serving", "regrouped", "serving", "regroup", 3),
    ("draining", "lost", "drained", "say, stop_replica, announce, node_ends", 3),
    ("draining", "drain_end", "drained", "say, stop_replica, announce, node_ends", 3),
    ("draining", "admit", "draining", "MISUSE", 3),
    ("draining", "admit_wrong_shape", "draining", "MISUSE", 3),
    ("draining", "ready", "draining", "MISUSE", 3),
    ("draining", "back", "serving", "say, announce", 3),
    ("draining", "drain", "draining", "MISUSE", 3),
    ("draining", "drain_heard", "draining", "", 3),
    ("draining", "scale_out", "draining", "MISUSE", 3),
    ("draining", "scale_in", "draining", "MISUSE", 3),
    ("draining", "tick", "draining", "MISUSE", 3),
    ("draining", "regrouped", "draining", "regroup", 3),
    ("drained", "lost", "drained", "say", 3),
    ("drained", "drain_end", "drained", "say", 3),
    ("drained", "admit", "drained", "MISUSE", 3),
    ("drained", "admit_wrong_shape", "drained", "MISUSE", 3),
    ("drained", "ready", "drained", "MISUSE", 3),
    ("drained", "back", "serving", "say, announce", 3),
    ("drained", "drain", "drained", "MISUSE", 3),
    ("drained", "drain_heard", "drained", "", 3),
    ("drained", "scale_out", "drained", "MISUSE", 3),
    ("drained", "scale_in", "drained", "MISUSE", 3),
    ("drained", "tick", "drained", "MISUSE", 3),
    ("drained", "regrouped", "drained", "regroup", 3),
    ("lost", "lost", "lost", "say", 3),
    ("lost", "drain_end", "lost", "say", 3),
    ("lost", "admit", "lost", "MISUSE", 3),
    ("lost", "admit_wrong_shape", "lost", "MISUSE", 3),
    ("lost", "ready", "lost", "MISUSE", 3),
    ("lost", "back", "serving", "say, announce", 3),
    ("lost", "drain", "lost", "MISUSE", 3),
    ("lost", "drain_heard", "lost", "", 3),
    ("lost", "scale_out", "lost", "MISUSE", 3),
    ("lost", "scale_in", "lost", "MISUSE", 3),
    ("lost", "tick", "lost", "MISUSE", 3),
    ("lost", "regrouped", "lost", "regroup", 3),
    ("serving", "welcomed", "serving", "", 3),
    ("draining", "welcomed", "draining", "", 3),
    ("drained", "welcomed", "drained", "", 3),
    ("lost", "welcomed", "lost", "", 3),
    ("serving", "resume", "serving", "MISUSE", 3),
    ("draining", "resume", "draining", "MISUSE", 3),
    ("drained", "resume", "drained", "MISUSE", 3),
    ("lost", "resume", "lost", "MISUSE", 3),
    # node 0 tells the followers the requested width, which they keep for a node 0 started again
    ("serving", "resume_drained", "serving", "MISUSE", 3),
    ("serving", "resume_lost", "serving", "MISUSE", 3),
    ("serving", "width_heard", "serving", "", 2),
    ("draining", "resume_drained", "draining", "MISUSE", 3),
    ("draining", "resume_lost", "draining", "MISUSE", 3),
    ("draining", "width_heard", "draining", "", 2),
    ("drained", "resume_drained", "drained", "MISUSE", 3),
    ("drained", "resume_lost", "drained", "MISUSE", 3),
    ("drained", "width_heard", "drained", "", 2),
    ("lost", "resume_drained", "lost", "MISUSE", 3),
    ("lost", "resume_lost", "lost", "MISUSE", 3),
    ("lost", "width_heard", "lost", "", 2),
]


def _run(node: int, phase: str, event: str) -> tuple[str, str, int]:
    r, k = into(phase, node)
    try:
        kinds = ", ".join(d.kind for d in r.handle(EVENTS[event](r, k)))
    except R.RosterMisuse:
        kinds = "MISUSE"
    return r.phase(k), kinds, r.requested


@pytest.mark.parametrize(("phase", "event", "after", "kinds", "width"), NODE_0)
def test_node_0_every_event_in_every_phase(phase: str, event: str, after: str, kinds: str, width: int) -> None:
    assert _run(0, phase, event) == (after, kinds, width)


@pytest.mark.parametrize(("phase", "event", "after", "kinds", "width"), FOLLOWER)
def test_a_follower_every_event_in_every_phase(phase: str, event: str, after: str, kinds: str, width: int) -> None:
    assert _run(1, phase, event) == (after, kinds, width)


def test_the_tables_cover_every_event_in_every_phase() -> None:
    assert {(p, e) for p, e, *_ in NODE_0} == set(itertools.product(R.PHASES, EVENTS))
    seen = {"serving", "draining", "drained", "lost"}
    assert {(p, e) for p, e, *_ in FOLLOWER} == set(itertools.product(seen, EVENTS))


def kinds(decisions: list[R.Decision]) -> list[str]:
    return [d.kind for d in decisions]


def test_a_lost_replica_rejoins_in_its_next_epoch_once_every_node_of_it_is_ready() -> None:
    r = make(0)
    assert kinds(r.handle(lost(1))) == ["say", "tell_down", "announce"]
    admitted = r.handle(R.Admit(1, 41, "s", "s"))
    assert admitted[-1] == R.Decision("admit", 1, epoch=1) and r.phase(1) == "rejoining"
    assert r.handle(R.Ready(frozenset({0, 2}))) == []  # its node is not ready yet
    back = r.handle(R.Ready(frozenset({0, 1, 2})))
    assert R.Decision("tell_up", 1, epoch=1) in back and r.state(1) == R.ReplicaState("serving", 1)
    assert r.counts(1) == (1, 1) and r.lost() == {} and r.effective == 3


def test_a_replacement_that_failed_is_replaced_again_in_a_new_epoch_and_its_partners_are_told() -> None:
    r = R.Roster(ParallelConfig(data_parallel_size=2, nnodes=4, node_rank=0, replica_coupling="independent"))
    r.handle(R.Lost(1, ReplicaLost(1, 2, [2, 3], "killed")))
    r.handle(R.Admit(2, 10, "s", "s"))
    r.handle(R.Admit(3, 11, "s", "s"))
    again = r.handle(R.Admit(2, 12, "s", "s"))  # node 2's replacement failed and was started again
    down = [d for d in again if d.kind == "tell_down"]
    assert len(down) == 1 and down[0].nodes == (3,) and "epoch 2" in down[0].text
    assert again[-1] == R.Decision("admit", 1, epoch=2)


def test_a_node_admitted_to_a_rejoin_and_lost_before_it_serves_gives_the_rejoin_up_and_its_partners_are_told() -> None:
    """Node 3's replacement lost while replica 1 rejoins (before every node of it reported ready): node 2, admitted
    with it, is told at once (it waits for a world, or a goodbye, that cannot come), the rejoin's epoch is spent, and
    the next replacements are admitted in the epoch after it with nobody told again."""
    r = R.Roster(ParallelConfig(data_parallel_size=2, nnodes=4, node_rank=0, replica_coupling="independent"))
    r.handle(R.Lost(1, ReplicaLost(1, 3, [3], "killed")))
    r.handle(R.Admit(2, 10, "s", "s"))
    r.handle(R.Admit(3, 11, "s", "s"))
    out = r.handle(R.Lost(1, ReplicaLost(1, 3, [3], "killed again")))
    assert kinds(out) == ["say", "tell_down"] and out[1].nodes == (2,), out
    assert "rejoin in epoch 1 is given up (node 3's replacement failed) and starts again in epoch 2" in out[1].text
    assert r.phase(1) == "rejoining" and r.epochs()[1] == 2
    assert r.handle(R.Admit(3, 12, "s", "s"))[-1] == R.Decision("admit", 1, epoch=2)
    again = r.handle(R.Admit(2, 13, "s", "s"))
    assert "tell_down" not in kinds(again) and again[-1] == R.Decision("admit", 1, epoch=2), again
    assert R.Decision("tell_up", 1, epoch=2) in r.handle(R.Ready(frozenset(range(4))))
    # (once it serves, a loss is a loss again: every node told)
    assert kinds(r.handle(R.Lost(1, ReplicaLost(1, 3, [3], "after")))) == ["say", "tell_down", "announce"]


def test_node_0_started_again_resumes_from_a_followers_epochs_its_own_replicas_one_past_them() -> None:
    """Node 0 (replicas 0 and 1 of 6 on 3 nodes) started again while node 1 served without it: every replica
    takes the epoch node 1 knew, node 0's own the one past it (counted as a rejoin); nothing else changes."""
    r = R.Roster(ParallelConfig(data_parallel_size=6, nnodes=3, node_rank=0, replica_coupling="independent"))
    out = r.handle(R.Resume(((0, 2), (1, 0), (2, 1), (3, 0), (4, 5), (5, 0)), 1))
    assert r.epochs() == {0: 3, 1: 1, 2: 1, 3: 0, 4: 5, 5: 0}, r.epochs()
    assert [d.kind for d in out] == ["say"] and "node 1" in out[0].text and "[0, 1] rejoin in epoch(s) [3, 1]" in (
        out[0].text
    ), out  # fmt: skip
    assert {k: s.state for k, s in r.states().items()} == dict.fromkeys(range(6), "serving")
    assert r.counts(0) == r.counts(1) == (0, 1) and r.counts(2) == (0, 0)
    # a follower that knew no epoch of node 0's replicas: they start again in epoch 1
    fresh = R.Roster(ParallelConfig(data_parallel_size=2, nnodes=2, node_rank=0, replica_coupling="independent"))
    fresh.handle(R.Resume(((1, 0),), 1))
    assert fresh.epochs() == {0: 1, 1: 0}


def test_node_0_started_again_resumes_the_drains_losses_and_width_a_follower_knew() -> None:
    """DP=4, one node each. The operator scales to 3 (replica 3 drains, then is drained), drains replica 2, and
    node 0 is lost while it drains: node 1 heard all of it (what node 0 told it, as the heartbeats carry it). A
    node 0 started again resumes from node 1's view: replica 3 drained, replica 2 drained (its nodes stop
    cleanly without node 0), the requested width 3, and its own replica 0 rejoining as before."""

    def roster(node: int) -> R.Roster:
        return R.Roster(ParallelConfig(data_parallel_size=4, nnodes=4, node_rank=node, replica_coupling="independent"))

    n0, n1 = roster(0), roster(1)

    def told(decisions: list[R.Decision]) -> None:  # (node 0's word, as node 1's heartbeat client hears it)
        for d in decisions:
            if d.kind == "tell_drain":
                n1.handle(R.DrainHeard(d.dp_rank))
            elif d.kind == "tell_width":
                n1.handle(R.WidthHeard(d.epoch))
            elif d.kind == "tell_down":
                assert d.cause is not None
                n1.handle(R.Lost(d.dp_rank, d.cause))

    told(n0.handle(R.Scale(3, 0.0, 30.0)))
    told(n0.handle(drained(3)))
    told(n0.handle(R.Drain(2)))
    n1.handle(lost(0, "node 0 was lost"))  # (node 1 counts node 0's replica lost, and serves on)
    assert n1.requested == 3 and [n1.phase(k) for k in range(4)] == ["lost", "serving", "draining", "drained"]
    out = n1.out_of_service()
    assert {k: type(e).__name__ for k, e in out.items()} == {0: "ReplicaLost", 2: "ReplicaDrained", 3: "ReplicaDrained"}
    again = roster(0)
    said = again.handle(R.Resume(tuple(n1.epochs().items()), 1, tuple(out.items()), n1.requested))
    assert [again.phase(k) for k in range(4)] == ["serving", "serving", "drained", "drained"], said
    assert again.requested == 3 and again.effective == 2 and again.epochs()[0] == 1
    assert "DP replica 2 drained; DP replica 3 drained; the requested DP width is 3" in said[0].text, said
    # replica 3's node started again is refused (past the width the operator asked for), replica 2's rejoins
    refused = again.handle(R.Admit(3, 77, "s", "s"))
    assert kinds(refused) == ["say", "refuse"] and "past the requested width 3" in refused[-1].text
    assert kinds(again.handle(R.Admit(2, 78, "s", "s"))) == ["say", "admit"]  # (replica 2's node: a rejoin)


OURS = "tp=2 pp=1 pcp=1 dp=3 nnodes=3 replicas=independent"


def test_scale_out_admits_the_new_replicas_nodes_and_serves_at_the_wider_width() -> None:
    """Past the replicas the cluster started with: the new node is started with --dp and --nnodes raised (its
    shape widens the cluster's), and its replica, which had no first start, starts in epoch 1."""
    r = make(0)
    answer = r.handle(R.Scale(4, 0.0, 30.0))
    assert "start node(s) [3]" in answer[-1].text and r.requested == 4 and r.effective == 3
    other = r.handle(R.Admit(3, 76, OURS.replace("dp=3 nnodes=3", "dp=4 nnodes=2"), OURS))  # (2 replicas a node)
    assert kinds(other) == ["say", "refuse"] and "for a wider DP width, only --dp and --nnodes" in other[-1].text
    assert r.handle(R.Admit(3, 77, OURS.replace("dp=3 nnodes=3", "dp=4 nnodes=4"), OURS))[-1] == R.Decision(
        "admit", 3, epoch=1
    )
    served = r.handle(R.Ready(frozenset(range(4)), now=5.0))
    assert R.Decision("tell_up", 3, epoch=1) in served
    assert r.effective == 4 and r.counts(3) == (0, 0)  # a new replica: no loss, no rejoin
    assert r.handle(R.Tick(1e9)) == []  # met: nothing to give up


def test_a_new_replica_given_up_and_asked_for_again_starts_in_a_later_epoch() -> None:
    r = make(0)
    r.handle(R.Scale(4, 0.0, 30.0))
    assert r.handle(R.Admit(3, 77, "s", "s"))[-1] == R.Decision("admit", 3, epoch=1)
    gave_up = r.handle(R.Tick(30.0))  # (its node never reported ready)
    assert [d.nodes for d in gave_up if d.kind == "tell_down"] == [(3,)] and r.phase(3) == "absent"
    r.handle(R.Scale(4, 40.0, 30.0))
    assert r.handle(R.Admit(3, 78, "s", "s"))[-1] == R.Decision("admit", 3, epoch=2)


@pytest.mark.parametrize(
    ("shape", "widens"),
    [
        ("tp=2 pp=1 pcp=1 dp=4 nnodes=4 replicas=independent", True),
        ("tp=2 pp=1 pcp=1 dp=6 nnodes=6 replicas=independent", True),
        ("tp=2 pp=1 pcp=1 dp=3 nnodes=3 replicas=independent", False),  # (the same: no wider)
        ("tp=2 pp=1 pcp=1 dp=2 nnodes=2 replicas=independent", False),
        ("tp=4 pp=1 pcp=1 dp=4 nnodes=4 replicas=independent", False),
        ("tp=2 pp=1 pcp=1 dp=4 nnodes=4 replicas=coupled", False),
        ("tp=2 pp=1 pcp=1 dp=4 nnodes=8 replicas=independent", False),
        ("tp=2 pp=1 pcp=1 dp=4 nnodes=4", False),
        ("garbled", False),
    ],
)
def test_a_wider_shape_differs_only_in_the_replicas_it_has(shape: str, widens: bool) -> None:
    from rayfree.cluster.join import widens as widens_of

    assert widens_of(shape, OURS) is widens


def test_a_scale_out_whose_nodes_do_not_come_is_given_up_and_the_width_is_as_it_was() -> None:
    r = make(0)
    before = r.states()
    r.handle(R.Scale(5, 10.0, 30.0))
    assert r.handle(R.Tick(39.9)) == []
    late = r.handle(R.Tick(40.0))
    assert kinds(late) == ["tell_width", "say"] and "[3, 4] did not all come in time" in late[1].text
    assert r.requested == 3 and r.states() == before and late[0].epoch == 3  # (the followers hear the width back)


def test_scale_in_drains_the_highest_replicas_and_refuses_their_nodes_afterwards() -> None:
    r = make(0)
    out = r.handle(R.Scale(1, 0.0, 30.0))
    assert [d.dp_rank for d in out if d.kind == "tell_drain"] == [1, 2] and r.requested == 1
    assert r.effective == 3  # draining replicas finish their calls in flight
    r.handle(drained(1))
    r.handle(drained(2))
    assert r.effective == 1 and r.phase(1) == r.phase(2) == "drained" and r.counts(1) == (0, 0)
    refused = r.handle(R.Admit(2, 90, "s", "s"))
    assert kinds(refused) == ["say", "refuse"] and "past the requested width 1" in refused[-1].text


@pytest.mark.parametrize(
    ("event", "says"),
    [
        (R.Scale(0, 0.0, 30.0), "at least one DP replica"),
        (R.Scale(-3, 0.0, 30.0), "at least one DP replica"),
        (R.Admit(40, 5, "s", "s"), "past the requested width 3"),
        (R.Drain(9), "there is no DP replica 9"),
        (R.Drain(0), "the last one node 0 serves"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(event: R.Event, says: str) -> None:
    r = make(0)
    before = (r.states(), r.requested, r.epoch)
    out = r.handle(event)
    assert says in out[-1].text and out[-1].kind in ("answer", "refuse")
    assert "\n" not in out[-1].text and (r.states(), r.requested, r.epoch) == before


def test_a_node_of_a_draining_replica_that_comes_back_is_refused_and_changes_nothing() -> None:
    r = make(0)
    r.handle(R.Drain(1))
    before = r.states()
    out = r.handle(R.Admit(1, 8, "s", "s"))
    assert out[-1].kind == "refuse" and "drain" in out[-1].text and r.states() == before
    assert kinds(r.handle(R.Admit(1, 8, "s", "s"))) == ["refuse"]  # said once per process


def test_a_refused_replacement_that_beats_again_without_its_shape_is_not_admitted() -> None:
    """A replacement of another shape is refused; until it exits it beats on, without its shape (node 0 answered
    it). Under load such a beat came before it left, and was admitted: replica 2 rejoined from a refused process
    in an epoch of its own."""
    r = make(0)
    r.handle(lost(2))
    assert kinds(r.handle(R.Admit(2, 70, "t", "s"))) == ["say", "refuse"]
    before = (r.states(), r.epoch)
    again = r.handle(R.Admit(2, 70, "", "s"))
    assert again[-1].kind == "ignore" and "without the shape" in again[-1].text, again
    assert (r.states(), r.epoch) == before and r.phase(2) == "lost"
    assert r.handle(R.Admit(2, 71, "s", "s"))[-1] == R.Decision("admit", 2, epoch=1)  # (the right one: epoch 1)


def test_coupled_replicas_form_a_new_membership_epoch_at_every_change_of_the_members() -> None:
    r = make(0, coupling="coupled")
    assert [d for d in r.handle(lost(1)) if d.kind == "regroup"] == [R.Decision("regroup", epoch=1, members=(0, 2))]
    r.handle(R.Admit(1, 3, "s", "s"))
    grown = [d for d in r.handle(R.Ready(frozenset(range(3)))) if d.kind == "regroup"]
    assert grown == [R.Decision("regroup", epoch=2, members=(0, 1, 2))]
    drain = r.handle(R.Drain(2))  # a coupled replica that drains leaves the groups at once: it takes no new call
    assert [d for d in drain if d.kind == "regroup"] == [R.Decision("regroup", epoch=3, members=(0, 1))]
    assert r.effective == 3 and [d.kind for d in r.handle(drained(2))].count("regroup") == 0  # (no change then)
    assert r.members == (0, 1) and r.epoch == 3 and r.effective == 2
    i = make(0)  # independent replicas: a draining one serves its calls in flight, a member until drained
    i.handle(R.Drain(2))
    assert i.members == (0, 1, 2) and i.handle(drained(2)) and i.members == (0, 1) and i.epoch == 1
    f = make(1, coupling="coupled")
    assert kinds(f.handle(R.Regrouped(2, (0, 2)))) == ["regroup"]
    assert f.handle(R.Regrouped(2, (0, 2))) == [] and f.handle(R.Regrouped(1, (0, 1, 2))) == []  # old news
    assert f.members == (0, 2)


@pytest.mark.parametrize(("end", "clean"), [(drained(1), 1), (lost(1), 0)])
def test_a_follower_left_with_no_replica_ends_cleanly_only_if_it_was_drained(end: R.Lost, clean: int) -> None:
    f = make(1)
    if clean:
        f.handle(R.DrainHeard(1))
    out = f.handle(end)
    assert R.Decision("stop_replica", 1, cause=out[1].cause) == out[1]
    assert out[-1].kind == "node_ends" and out[-1].epoch == clean


FAULTS: list[Callable[[], R.Event]] = [
    lambda: lost(1),
    lambda: R.Admit(1, 61, "s", "s"),
    lambda: R.Ready(frozenset(range(4)), now=50.0),
    lambda: R.Scale(4, 0.0, 30.0),
    lambda: R.Drain(2),
    lambda: R.Tick(100.0),
]


def test_every_order_of_a_set_of_faults_keeps_the_roster_consistent() -> None:
    """720 orders of a loss, its replacement, readiness, a scale-out, a drain and time passing: no order raises,
    the members are always the serving replicas (coupled: a draining one has left the groups), no replica's epoch
    goes back, the width stays >= 1."""
    endings = set()
    for order in itertools.permutations(range(len(FAULTS))):
        r = make(0, coupling="coupled")
        epochs, epoch = r.epochs(), r.epoch
        for i in order:
            r.handle(FAULTS[i]())
            assert r.members == tuple(k for k in r.replicas() if r.phase(k) == "serving"), order  # (coupled)
            now = r.epochs()  # (a new replica given up is absent: its next try starts past it, a test above)
            assert r.epoch >= epoch and all(now[k] >= e for k, e in epochs.items() if k in now), order
            assert 1 <= r.effective <= len(r.replicas()) and r.requested >= 1, order
            epochs, epoch = r.epochs(), r.epoch
        endings.add(tuple(r.phase(k) for k in range(4)))
    assert ("serving", "serving", "draining", "absent") in endings and len(endings) > 3, endings
