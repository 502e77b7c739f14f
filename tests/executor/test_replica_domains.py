"""Failure domains of DP replicas on one node (NodeReplicas, real workers and gloo worlds): an independent
replica that loses a worker fails alone, with ReplicaLost, while the node's other replica serves on; so does a
coupled one, whose survivors' groups across replicas shrink; replicas in one world fail together
(ReplicaFailed). Across nodes: tests/cluster/test_dp.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rayfree import ExecutorFailed, ReplicaDrained, ReplicaFailed, ReplicaLost, WorkerDied
from rayfree.cluster.config import ClusterConfig, ConfigError, ParallelConfig
from rayfree.executor.replicas import NodeReplicas
from rayfree.transport import get_open_port

ECHO = "tests.support.sample_workers:EchoWorker"


def all_reduce(worker) -> float:
    """A collective over the rank's world (its replica's, or every replica's in one world)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def start(coupling: str) -> NodeReplicas:
    par = ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, master_port=get_open_port("127.0.0.1"), replica_coupling=coupling
    )
    config = ClusterConfig(parallel=par, ready_timeout_s=120, shutdown_grace_s=1, shutdown_term_s=1)
    return NodeReplicas(config, ECHO, {"distributed": True})


def test_the_coupling_setting_resolves_from_expert_parallelism_and_refuses_what_it_does_not_know() -> None:
    def tied(**kw) -> tuple[bool, bool]:
        par = ParallelConfig(**kw).validate()
        return par.coupled, par.one_world

    assert tied(data_parallel_size=2) == (False, False)  # (independent)
    assert tied(data_parallel_size=2, enable_expert_parallel=True) == (True, False)  # experts: groups across
    assert tied(data_parallel_size=2, enable_expert_parallel=True, replica_coupling="independent") == (False, False)
    assert tied(data_parallel_size=2, replica_coupling="coupled") == (True, False)
    assert tied(data_parallel_size=2, enable_expert_parallel=True, replica_coupling="one-world") == (False, True)
    assert tied(replica_coupling="coupled") == tied(replica_coupling="one-world") == (False, False)  # one replica
    with pytest.raises(ConfigError, match="replica_coupling='loose': use independent, coupled, one-world or auto"):
        ParallelConfig(data_parallel_size=2, replica_coupling="loose").validate()


@pytest.mark.timeout(180)
def test_an_independent_replica_that_loses_a_worker_fails_alone_and_the_other_serves_on() -> None:
    reps = start("independent")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        assert ex0.collective_rpc(all_reduce, timeout=60) == [2.0, 2.0]  # a world of its replica's two ranks
        assert ex1.collective_rpc(all_reduce, timeout=60) == [2.0, 2.0]
        heard: list = []
        got = threading.Event()
        ex0.register_replica_callback(lambda k, st: (heard.append((k, st)), got.set()))
        pids0 = [w.proc.pid for w in ex0.workers]
        victim = ex1.workers[1].proc.pid
        os.kill(victim, signal.SIGKILL)
        assert got.wait(30), "replica 0 was not told of replica 1's loss"
        with pytest.raises(ReplicaLost) as lost:
            ex1.collective_rpc("echo", args=(1,), timeout=30)
        assert isinstance(lost.value, ExecutorFailed) and isinstance(lost.value.cause, WorkerDied)
        assert (lost.value.dp_rank, lost.value.node_rank, lost.value.ranks) == (1, 0, [3]), lost.value
        assert "DP replica 1 was lost: node 0, ranks [3]: worker rank 1 died" in str(lost.value)
        for _ in range(20):  # replica 0 serves on, the same processes
            assert ex0.collective_rpc(all_reduce, timeout=30) == [2.0, 2.0]
        assert [w.proc.pid for w in ex0.workers] == pids0 and all(w.proc.is_alive() for w in ex0.workers)
        assert [k for k, _ in heard] == [1] and heard[0][1].state == "lost" and "ranks [3]" in heard[0][1].why
        states = ex0.replica_states()
        assert (states[0].state, states[1].state) == ("serving", "lost"), states
        assert ex1.wait_done(30)
        samples = scrape(reps.liveness)
    finally:
        reps.shutdown()
    assert reps.failure is not None and not reps.liveness.failure  # a replica's, not the node's
    for k, serving, losses in ((0, 1, 0), (1, 0, 1)):
        labels = (("node", "0"), ("replica", str(k)))
        assert samples[("rayfree_replica_serving", labels)] == serving, samples
        assert samples[("rayfree_replica_losses_total", labels)] == losses, samples
        assert (
            samples[("rayfree_replica_rejoins_total", labels)] == 0 and samples[("rayfree_replica_epoch", labels)] == 0
        )


def scrape(liveness) -> dict:
    """This node's /metrics, served and read over HTTP as Prometheus would."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from rayfree.cli.metrics import serve_metrics

    port = get_open_port("127.0.0.1")
    server = serve_metrics(port, liveness, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.timeout(180)
def test_replicas_in_one_world_fail_together() -> None:
    reps = start("one-world")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        assert ex0.collective_rpc("echo", args=(1,), timeout=60) == [1, 1]
        failed = threading.Event()
        ex0.register_failure_callback(failed.set)
        os.kill(ex1.workers[1].proc.pid, signal.SIGKILL)
        assert failed.wait(30), "replica 0 did not fail with replica 1"
        with pytest.raises(ReplicaFailed, match="DP replica 1 on this node failed"):
            ex0.collective_rpc("echo", args=(1,), timeout=30)
        with pytest.raises(WorkerDied):
            ex1.collective_rpc("echo", args=(1,), timeout=30)
    finally:
        reps.shutdown()


def slow_rank(worker, seconds: float) -> int:
    """A call that is still in flight when the drain begins."""
    import time

    time.sleep(seconds)
    return worker.rank


@pytest.mark.timeout(180)
def test_a_drained_replica_finishes_its_call_in_flight_then_stops_while_the_other_serves_on() -> None:
    """`rayfree drain` on one node (NodeReplicas.drain, what node 0 runs for the command): replica 1 is marked
    draining at once and takes no new call (ReplicaDrained at once, as the docs say), its call in flight returns
    its answer, then it stops and refuses calls with ReplicaDrained;
    replica 0 serves on with the same processes, and the node itself has not failed."""
    reps = start("independent")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        heard: list = []
        drained = threading.Event()
        ex0.register_replica_callback(
            lambda k, st: (heard.append((k, st.state)), st.state == "drained" and drained.set())
        )
        pids0 = [w.proc.pid for w in ex0.workers]
        answer: list = []
        call = threading.Thread(target=lambda: answer.append(ex1.collective_rpc(slow_rank, args=(2.0,), timeout=60)))
        call.start()
        for _ in range(400):  # until the call is in flight (bounded)
            snap = ex1.rpc_snapshot()
            if snap is not None and snap.calls:
                break
            threading.Event().wait(0.01)
        assert snap is not None and snap.calls, "the slow call never showed in flight"
        line = reps.drain(1)
        assert line.startswith("DP replica 1 drains: its calls in flight finish"), line
        assert reps.drain(1) == "refused: DP replica 1 is draining, not serving"
        assert reps.drain(0).startswith("refused: DP replica 0 is the last one node 0 serves, and node 0 leads")
        assert reps.drain(2) == "refused: there is no DP replica 2 (replicas 0-1)"
        assert ex0.replica_states()[1].state in ("draining", "drained")
        with pytest.raises(ReplicaDrained, match="DP replica 1 was drained") as early:  # (no new call, at once)
            ex1.collective_rpc("echo", args=(1,), timeout=30)
        assert "takes no new calls" in str(early.value) or drained.is_set(), early.value
        assert drained.wait(30), heard
        call.join(30)
        assert answer == [[0, 1]], answer  # the call in flight finished with its answer
        with pytest.raises(ReplicaDrained, match="DP replica 1 was drained") as err:
            ex1.collective_rpc("echo", args=(1,), timeout=30)
        assert isinstance(err.value, ReplicaLost) and err.value.dp_rank == 1
        assert ex1.wait_done(30) and not any(w.proc.is_alive() for w in ex1.workers)
        for _ in range(10):
            assert ex0.collective_rpc(all_reduce, timeout=30) == [2.0, 2.0]
        assert [w.proc.pid for w in ex0.workers] == pids0
        assert heard == [(1, "draining"), (1, "drained")], heard
        assert {k: s.state for k, s in ex0.replica_states().items()} == {0: "serving", 1: "drained"}
        assert reps.drain(1) == "refused: DP replica 1 is drained, not serving"
        assert reps.failure is None and reps.liveness.failure is None
        samples = scrape(reps.liveness)
        labels = (("node", "0"), ("replica", "1"))
        assert samples[("rayfree_replica_serving", labels)] == 0, samples
        assert samples[("rayfree_replica_losses_total", labels)] == 0, samples  # a drain is no loss
    finally:
        reps.shutdown()


class Lockstep:
    """Coupled replicas' leaders stepping the toy, each in a thread of its own (its all-reduce across replicas
    keeps them in step), every step checked: its output against the model in one process, the replicas its sum
    across replicas names. A step that meets a change of the members raises ReplicasChanged and runs again;
    `stop` ends every survivor at one agreed step over the final members (one that stopped on a flag between two
    steps while another had begun its next would leave that one alone in the collective). Steps are counted per
    member set, not in all: a collective that a lost member left can finish on one survivor and fail on another,
    so their step numbers may differ by one while their steps over the new group pair one to one."""

    def __init__(self, leaders: list) -> None:
        self.leaders = leaders
        self.seen: dict[int, list] = {ex.dp_rank: [] for ex in leaders}
        self.ended: dict[int, str] = {}
        self.done = {ex.dp_rank: 0 for ex in leaders}  # steps each replica finished
        self.stop_at: list[tuple[list[int], int]] = []  # (members, steps over them): where every survivor ends
        self.progress = threading.Condition()
        self.threads = [threading.Thread(target=self._steps, args=(ex,)) for ex in leaders]
        for t in self.threads:
            t.start()

    def _steps(self, ex) -> None:
        from rayfree import ReplicasChanged
        from rayfree.cli.toy_engine import reference_forward
        from tests.support.multinode_entry import coupled_batch, members_of, torch_equal

        k, step = ex.dp_rank, 0
        try:
            while not self._reached(k):
                batch = coupled_batch(step, k)
                try:
                    out = ex.execute_model(batch)
                    total = ex.collective_rpc("step_report", unique_reply_rank=0, timeout=30)["dp_sum"]
                except ReplicasChanged as e:
                    self.seen[k].append(("changed", e.members))
                    continue
                self.seen[k].append((members_of(total), torch_equal(out, reference_forward(batch["x"]))))
                step += 1
                with self.progress:
                    self.done[k] = step
                    self.progress.notify_all()
        except ExecutorFailed as e:
            self.ended[k] = type(e).__name__
            with self.progress:
                self.progress.notify_all()

    def _reached(self, k: int) -> bool:
        with self.progress:
            if not self.stop_at:
                return False
            members, n = self.stop_at[0]
            return self.steps_over(k, members) >= n

    def until(self, what) -> None:
        with self.progress:
            assert self.progress.wait_for(what, 60), self.seen

    def steps_over(self, k: int, members: list[int]) -> int:
        return sum(s[0] == members for s in self.seen[k])

    def stop(self, survivors: list[int]) -> None:
        with self.progress:  # (past the step any may be in now)
            self.stop_at.append((survivors, max(self.steps_over(k, survivors) for k in survivors) + 2))
        for t in self.threads:
            t.join(60)
            assert not t.is_alive(), self.seen
        over = {k: self.steps_over(k, survivors) for k in survivors}
        assert set(over.values()) == {self.stop_at[0][1]}, (over, self.done, self.stop_at)

    def abandon(self) -> None:
        with self.progress:
            if not self.stop_at:
                self.stop_at.append(([], 0))

    def assert_shrunk(self, k: int, before: list[int], after: list[int]) -> None:
        """Replica k's steps: over `before`, then (a step that met the change: again) over `after`, all right."""
        runs = [s[0] for s in self.seen[k]]
        first = runs.index(after)
        assert all(r in ("changed", before) for r in runs[:first]), runs
        assert all(s[1] == after for s in self.seen[k] if s[0] == "changed"), self.seen[k]
        assert all(s[0] == after and s[1] == 1 for s in self.seen[k][first:]), self.seen[k][first:]
        assert all(s[1] == 1 for s in self.seen[k] if s[0] == before), self.seen[k]


def coupled_three(tp: int = 1) -> NodeReplicas:
    par = ParallelConfig(
        tensor_parallel_size=tp,
        data_parallel_size=3,
        master_port=get_open_port("127.0.0.1"),
        replica_coupling="coupled",
    )
    config = ClusterConfig(parallel=par, ready_timeout_s=120, shutdown_grace_s=1, shutdown_term_s=1)
    return NodeReplicas(config, "tests.support.coupled_worker:CoupledToyWorker")


def replica_2_goes(change, tp: int = 1, first=None) -> tuple[Lockstep, object, list, tuple, dict]:
    """DP=3 x TP=`tp` coupled on one node, stepping in lockstep: after 5 steps each (and, with `first`, after
    `first(leaders)` and 3 more steps each), `change(leaders)` makes replica 2 go; then the survivors step 10
    times over [0, 1], with the same processes. The run, what `change` gave, the survivors' hook calls, and
    replica 0's widths and replica states at the end."""
    reps = coupled_three(tp)
    try:
        leaders = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        pids = [[w.proc.pid for w in ex.workers] for ex in leaders[:2]]
        run = Lockstep(leaders)
        try:
            run.until(lambda: all(len(run.seen[k]) >= 5 for k in range(3)))
            if first is not None:
                first(leaders)
                at = {k: len(run.seen[k]) for k in range(3)}
                run.until(lambda: all(len(run.seen[k]) >= at[k] + 3 for k in range(3)))
            said = change(leaders)
            run.until(lambda: all(run.steps_over(k, [0, 1]) >= 10 for k in (0, 1)) and 2 in run.ended)
            run.stop([0, 1])
        finally:
            run.abandon()
        hooks = [ex.collective_rpc("hook_calls", timeout=30) for ex in leaders[:2]]
        widths = leaders[0].replica_widths()
        states = {k: st.state for k, st in leaders[0].replica_states().items()}
        assert [[w.proc.pid for w in ex.workers] for ex in leaders[:2]] == pids
    finally:
        reps.shutdown()
    for k in (0, 1):
        run.assert_shrunk(k, [0, 1, 2], [0, 1])
    assert hooks == [[[[1, [0, 1]]]] * tp] * 2, hooks  # each survivor's every rank ran the hook once
    return run, said, hooks, widths, states


@pytest.mark.timeout(180)
def test_coupled_replicas_shrink_their_groups_across_replicas_when_one_loses_a_worker() -> None:
    """One node, DP=3 x TP=1, coupled, each replica's leader stepping in a thread of its own: a worker of
    replica 2 is killed. A survivor's step that met it raises ReplicasChanged (one between two steps meets
    nothing), and their steps from then on run over replicas [0, 1], every output right, with the same
    processes; replica 2's calls raise ReplicaLost. Across nodes, with a rejoin: tests/cluster/test_coupled.py."""
    run, _, _, _, states = replica_2_goes(kill_replica_2)
    assert run.ended == {2: "ReplicaLost"}, (run.ended, run.seen[2][-3:])
    assert states == {0: "serving", 1: "serving", 2: "lost"}, states


def kill_replica_2(leaders: list) -> None:
    os.kill(leaders[2].workers[0].proc.pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_coupled_replicas_scale_in_from_the_engine_while_they_step() -> None:
    """One node, DP=3 x TP=1, coupled, stepping in lockstep: replica 0's engine asks for width 2. Replica 2 drains
    (its calls then raise ReplicaDrained, not a loss), the survivors' groups across replicas form over [0, 1]
    (the worker's hook says so) and every step from then on is right, with the same processes; no replica fails.
    Across nodes, with the width back: tests/cluster/test_scale.py."""
    run, said, _, widths, states = replica_2_goes(lambda leaders: leaders[0].scale_replicas(2))
    assert said == "DP width 3 -> 2: replicas [2] drain, then their nodes exit 0", said
    assert run.ended == {2: "ReplicaDrained"}, (run.ended, run.seen[2][-3:])
    assert widths == (2, 2, 1) and states == {0: "serving", 1: "serving", 2: "drained"}, (widths, states)


@pytest.mark.timeout(180)
def test_the_engine_scales_in_from_node_0_and_reads_the_widths() -> None:
    """`executor.scale_replicas(1)` from replica 0's engine (what `rayfree scale --dp 1` asks node 0): replica 1
    drains and stops, replica 0 serves on; the engine's `replica_widths()` and node 0's /metrics give the
    requested and serving width; a width past the laid-out --dp, or 0, is refused in one line, changing nothing."""
    reps = start("independent")
    try:
        ex0, ex1 = sorted(reps.leaders, key=lambda ex: ex.dp_rank)
        drained = threading.Event()
        ex0.register_replica_callback(lambda k, st: st.state == "drained" and drained.set())
        assert ex0.replica_widths() == (2, 2, 0)
        assert ex0.scale_replicas(3).startswith("refused: this cluster was laid out for 2 DP replica(s)")
        assert ex0.scale_replicas(0).startswith("refused: a cluster serves with at least one DP replica")
        assert ex0.replica_widths() == (2, 2, 0)
        assert ex0.scale_replicas(1) == "DP width 2 -> 1: replicas [1] drain, then their nodes exit 0"
        assert drained.wait(30)
        assert ex0.replica_widths() == (1, 1, 1)  # (a draining replica is still a member; drained, it is not)
        with pytest.raises(ReplicaDrained):
            ex1.collective_rpc("echo", args=(1,), timeout=30)
        assert ex0.collective_rpc(all_reduce, timeout=30) == [2.0, 2.0]
        samples = scrape(reps.liveness)
        assert samples[("rayfree_dp_width", (("kind", "requested"), ("node", "0")))] == 1, samples
        assert samples[("rayfree_dp_width", (("kind", "serving"), ("node", "0")))] == 1, samples
    finally:
        reps.shutdown()


def leave_if_rank_1(worker) -> bool:
    """What a rank does when its collective across replicas failed while its TP peer's passed: leave its groups."""
    from rayfree.cluster.across_replicas import drop

    if worker.rank == 1:
        drop()
    return worker.rank == 1


@pytest.mark.timeout(240)
def test_a_rank_whose_collective_across_replicas_failed_alone_stays_and_its_replica_serves_on() -> None:
    """DP=3 x TP=2 coupled on one node, in lockstep: replica 1's rank 1 leaves its groups across replicas as it
    does when its collective across replicas failed while its TP peer's passed (a replica lost between the two).
    Its next steps meet GroupLeft there, read as a lost peer: the rank stays, replica 1 is not lost, and once
    replica 2 is lost the survivors step over [0, 1], every output right, with the same processes. (A left group
    that handed torch None, or no group at all, made that rank's next step replica 1's failure with replica 2's.)"""

    def leave(leaders: list) -> None:
        assert leaders[1].collective_rpc(leave_if_rank_1, timeout=30) == [False, True]

    run, _, _, _, states = replica_2_goes(kill_replica_2, tp=2, first=leave)
    assert run.ended == {2: "ReplicaLost"}, (run.ended, run.seen)
    assert states == {0: "serving", 1: "serving", 2: "lost"}, states
