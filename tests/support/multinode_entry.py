"""Leader entry points for the multi-node tests (`rayfree node --entry tests.support.multinode_entry:NAME`).

Each prints lines `TAG:{json}` for the test to read and returns the exit code.
Callables sent to the workers live here, so the workers import them by name.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

# (torch at the top, not in the entries: an import inside the entry holds Python's lock for seconds while the
# node's heartbeats run, and its peers may call it lost; the docs ask the same of every entry point)
import torch

from rayfree.cli.toy_engine import dp_sum, make_batch, reference_forward


def say(tag: str, **kw: Any) -> None:
    """One line in one write (so no log line from another thread lands inside it)."""
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def where(worker: Any) -> dict:
    from rayfree.worker.proc import worker_info

    return worker_info(worker)


def groups(worker: Any) -> dict:
    """The size of the world a rank joined and of its DP group (independent replicas: its replica, and 1)."""
    from rayfree.cluster.parallel_state import get_dp_group, get_world_group

    return {"rank": worker.rank, "world": get_world_group().world_size, "dp": get_dp_group().world_size}


def tensor_home(worker: Any, t: Any) -> dict:
    """Where a received tensor's bytes live (a shared-memory mapping: the node's ring, or not), and their sum."""
    from tests.support.memory import in_shared_memory

    return {"rank": worker.rank, "shared": in_shared_memory(t.data_ptr()), "sum": float(t.double().sum())}


def shared_arguments(ex) -> int:
    """A 32 MiB argument, eight times, to every rank: where each rank found its bytes."""

    t = torch.arange(8 << 20, dtype=torch.float32)
    homes = [ex.collective_rpc(tensor_home, args=(t,), timeout=120) for _ in range(8)]
    say("RESULT", homes=homes[-1], sums_ok=all(h["sum"] == float(t.double().sum()) for r in homes for h in r))
    return 0


def fail_on(worker: Any, rank: int) -> int:
    if worker.rank == rank:
        raise KeyError(f"raised on purpose by rank {rank}")
    return worker.rank


def nap(worker: Any, seconds: float) -> int:
    """Stands in for a long step: the remote node is busy in it when it is killed or cut off."""
    time.sleep(seconds)
    return worker.rank


def check(ex) -> int:
    """Toy engine equals the 1-process model; replies from remote ranks; unique_reply_rank on a remote rank;
    a remote rank's exception; the tiny round trip to remote and to local ranks."""

    from rayfree.executor import WorkerError

    steps = 20
    equal = sum(
        torch.equal(ex.execute_model(make_batch(s)), reference_forward(make_batch(s)["x"])) for s in range(steps)
    )
    info = ex.collective_rpc(where, timeout=60)
    remote = [r["rank"] for r in info if r["node"] != 0]
    unique = ex.collective_rpc(where, unique_reply_rank=remote[-1], timeout=60)
    try:
        ex.collective_rpc(fail_on, args=(remote[0],), timeout=60)
        error = ""
    except WorkerError as e:
        error = str(e)
    after = ex.collective_rpc("check_health", timeout=60)

    def rtt(rank: int, n: int = 300) -> float:
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            ex.collective_rpc("check_health", unique_reply_rank=rank)
            xs.append(time.perf_counter() - t)
        return sorted(xs)[n // 2] * 1e6

    say(
        "RESULT",
        steps=steps,
        equal=int(equal),
        info=info,
        unique=unique,
        error=error,
        after=after,
        rtt_local_us=rtt(0),
        rtt_remote_us=rtt(remote[0]),
    )
    return 0


def hang(ex) -> int:
    """A call every rank is busy in; the test takes a node away; report how and when the call failed."""
    fut = ex.collective_rpc(nap, args=(120.0,), non_block=True)
    return _until_lost(ex, lambda: fut.result(timeout=100))


def cut_stream(ex) -> int:
    """Where node 0's broadcast stream is served (the test cuts node 1's relay off it), then a call every rank
    is busy in, and how it failed."""
    endpoint = ex.rpc_broadcast_mq.export_handle().remote_endpoint
    fut = ex.collective_rpc(nap, args=(120.0,), non_block=True)
    say("STREAM", endpoint=endpoint)
    return _until_lost(ex, lambda: fut.result(timeout=100))


def step_until_lost(ex) -> int:
    """Toy engine steps (PP send/recv between the nodes) until the test takes a node away: the peers' gloo
    calls fail first, and the executor must still name the lost node as the cause."""

    def steps() -> None:
        for s in range(1_000_000):
            ex.execute_model(make_batch(s))

    for s in range(5):
        ex.execute_model(make_batch(s))
    return _until_lost(ex, steps)


def _until_lost(ex, pending) -> int:
    from rayfree import ExecutorError, ExecutorFailed, NodeLost

    fired = []
    ex.register_failure_callback(lambda: fired.append(time.monotonic()))
    say("PENDING", t=time.monotonic())
    error = kind = ""
    try:
        pending()
    except NodeLost as e:  # by the name the docs give it
        error, kind = str(e), "NodeLost" + ("+ExecutorFailed" if isinstance(e, ExecutorFailed) else "")
    except ExecutorError as e:
        error, kind = str(e), type(e).__name__
    t_fail = time.monotonic()
    later_kind = ""
    try:
        ex.collective_rpc("check_health", timeout=10)
        later = "a later call succeeded"
    except NodeLost as e:
        later, later_kind = str(e), "NodeLost"
    except ExecutorError as e:
        later, later_kind = str(e), type(e).__name__
    t_later = time.monotonic() - t_fail
    ex.wait_done(60)
    say(
        "RESULT",
        t_fail=t_fail,
        error=error,
        kind=kind,
        later=later,
        later_kind=later_kind,
        later_s=t_later,
        callbacks=len(fired),
    )
    return 0


def steps_while_a_replica_is_lost(ex) -> int:
    """Toy steps until this replica fails or another one is reported lost (the test takes a node of replica 1
    away); a survivor then takes 20 more steps and says what it saw."""
    from rayfree import ExecutorFailed

    seen: list = []
    ex.register_replica_callback(lambda k, st: seen.append([k, st.state, st.why, time.monotonic()]))
    steps = 0
    say("STEPPING", replica=ex.dp_rank, t=time.monotonic())
    try:
        until = time.monotonic() + 120
        while not seen and time.monotonic() < until:
            ex.execute_model(make_batch(steps, replica=ex.dp_rank))
            steps += 1
        t_seen, after, equal = time.monotonic(), 0, 0
        for s in range(20):
            batch = make_batch(s, replica=ex.dp_rank)
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
            after += 1
        states = {k: [v.state, v.why] for k, v in ex.replica_states().items()}
        say("RESULT", replica=ex.dp_rank, outcome="served", steps=steps, after=after, equal=equal, seen=seen,
            t_seen=t_seen, states=states)  # fmt: skip
        _hold()
        return 0
    except ExecutorFailed as e:
        return _failed(ex, e, steps)


def _hold() -> None:
    """With RF_HOLD=PATH: the entry returns once the test made that file (it asks the node something first)."""
    path = os.environ.get("RF_HOLD")
    until = time.monotonic() + 120
    while path and not os.path.exists(path) and time.monotonic() < until:
        time.sleep(0.05)


def _failed(ex, e, steps: int) -> int:
    """Say how this replica's call failed (`e`), and what a later call gets."""
    from rayfree import ExecutorFailed, ReplicaLost

    t_fail = time.monotonic()
    try:
        ex.collective_rpc("check_health", timeout=10)
        later = "a later call succeeded"
    except ExecutorFailed as e2:
        later = type(e2).__name__
    say("RESULT", replica=ex.dp_rank, outcome="failed", steps=steps, t_fail=t_fail, kind=type(e).__name__,
        replica_lost=isinstance(e, ReplicaLost), error=str(e), lost_dp=getattr(e, "dp_rank", None),
        lost_node=getattr(e, "node_rank", None), lost_ranks=getattr(e, "ranks", None), later=later)  # fmt: skip
    return 1


def steps_until_this_replica_fails(ex) -> int:
    """Checked toy steps until this replica's call fails (bounded: 180 s), then says how (as
    steps_while_a_replica_is_lost)."""
    from rayfree import ExecutorFailed

    say("STEPPING", replica=ex.dp_rank, t=time.monotonic())
    steps, until = 0, time.monotonic() + 180
    try:
        while time.monotonic() < until:
            batch = make_batch(steps, replica=ex.dp_rank)
            if not torch_equal(ex.execute_model(batch), reference_forward(batch["x"])):
                say("RESULT", replica=ex.dp_rank, outcome="wrong", steps=steps)
                return 1
            steps += 1
    except ExecutorFailed as e:
        return _failed(ex, e, steps)
    say("RESULT", replica=ex.dp_rank, outcome="served", steps=steps)
    return 0


def steps_through_rejoins(ex) -> int:
    """Replica 0's leader: toy steps until replica 1 has rejoined RF_REJOINS times, then 20 more (or until the file
    RF_TAIL_UNTIL_FILE exists). Replica 1's
    leader: steps until its replica is lost (epoch 0), or 20 steps once it rejoined (a later epoch)."""
    from rayfree import ExecutorFailed

    epoch, want = ex.parallel_config.replica_epoch, int(os.environ.get("RF_REJOINS", "1"))
    seen: list = []
    ex.register_replica_callback(lambda k, st: seen.append([k, st.state, st.epoch, time.monotonic()]))
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, pid=os.getpid(), t=time.monotonic())
    steps = equal = after = 0
    try:
        until = time.monotonic() + 300
        while time.monotonic() < until:
            # (a rejoined replica hears its own return too, when its callback is in place before node 0 says so)
            back = [x[1] for x in seen if x[0] != ex.dp_rank].count("serving")
            if (ex.dp_rank != 0 and epoch > 0 and steps >= 20) or (ex.dp_rank == 0 and back >= want):
                break
            batch = make_batch(steps, replica=ex.dp_rank)
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
            steps += 1
        tail = os.environ.get("RF_TAIL_UNTIL_FILE", "")  # replica 0 steps on until the test makes it (bounded)
        until = time.monotonic() + 120
        while ex.dp_rank == 0 and (after < 20 or (tail and not os.path.exists(tail) and time.monotonic() < until)):
            batch = make_batch(after, replica=0)
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
            after += 1
        states = {k: [v.state, v.epoch] for k, v in ex.replica_states().items()}
        say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="served", steps=steps, after=after, equal=equal,
            seen=seen, states=states)  # fmt: skip
        return 0
    except ExecutorFailed as e:
        say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="failed", kind=type(e).__name__, steps=steps)
        return 1


def steps_through_node_0_restart(ex) -> int:
    """Independent replicas, one a node. The replicas RF_BACK names (node 0's, "0", by default) step until their
    node is killed, and once started again (a later epoch) take 20 checked steps. Every other replica steps,
    checked, until it has heard each of them serve again in a later epoch, then 20 more, and says what it saw
    (then waits for RF_HOLD's file, where set)."""
    from rayfree import ExecutorFailed

    epoch, back = ex.parallel_config.replica_epoch, [int(k) for k in os.environ.get("RF_BACK", "0").split(",")]
    seen: list = []
    ex.register_replica_callback(lambda k, st: seen.append([k, st.state, st.epoch, time.monotonic()]))
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, pid=os.getpid(), t=time.monotonic())
    steps = equal = after = 0

    def all_back() -> bool:
        return all(any(j == k and state == "serving" and e > 0 for j, state, e, _t in seen) for k in back)

    try:
        until = time.monotonic() + 240
        while time.monotonic() < until and (epoch == 0 if ex.dp_rank in back else not all_back()):
            batch = make_batch(steps, replica=ex.dp_rank)
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
            steps += 1
        for s in range(20):
            batch = make_batch(s, replica=ex.dp_rank)
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
            after += 1
        states = {k: [v.state, v.epoch] for k, v in ex.replica_states().items()}
        say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="served", steps=steps, after=after, equal=equal,
            seen=seen, states=states, t=time.monotonic())  # fmt: skip
        _hold()
        return 0
    except ExecutorFailed as e:
        say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="failed", kind=type(e).__name__, error=str(e),
            steps=steps)  # fmt: skip
        return 1


def steps_through_drain(ex) -> int:
    """Replica 0's leader: toy steps until replica 1 was drained and serves again, then 20 more. Replica 1's
    leader in epoch 0: steps until its replica drains (an engine routes nothing new to it), waits until it is
    drained, and makes one more call, which must be refused; in a later epoch (it was brought back): 20 steps."""
    from rayfree import ReplicaDrained

    epoch, seen = ex.parallel_config.replica_epoch, []
    ex.register_replica_callback(lambda k, st: seen.append([k, st.state, st.epoch]))
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, t=time.monotonic())
    steps = equal = 0
    until = time.monotonic() + 300

    def step() -> None:
        nonlocal steps, equal
        batch = make_batch(steps, replica=ex.dp_rank)
        equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
        steps += 1

    if ex.dp_rank == 1 and epoch == 0:
        early = ""  # (a call made once the replica drains, before its callback was heard, is refused at once)
        while not any(s[1] == "draining" for s in seen) and time.monotonic() < until:
            try:
                step()
            except ReplicaDrained as e:
                early = str(e)
                break
        while not any(s[1] == "drained" for s in seen) and time.monotonic() < until:
            time.sleep(0.02)
        try:
            step()
            refused = ""
        except ReplicaDrained as e:
            refused = str(e)
        say("RESULT", replica=1, epoch=epoch, outcome="drained", steps=steps, equal=equal, refused=refused, seen=seen,
            early=early)  # fmt: skip
        return 0
    while time.monotonic() < until and not (
        (ex.dp_rank == 0 and any(s[1] == "serving" for s in seen)) or (ex.dp_rank == 1 and steps >= 20)
    ):
        step()
    after = steps
    while ex.dp_rank == 0 and steps < after + 20:
        step()
    states = {k: [v.state, v.epoch] for k, v in ex.replica_states().items()}
    say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="served", steps=steps, equal=equal, seen=seen,
        states=states, widths=list(ex.replica_widths()))  # fmt: skip
    return 0


def widening(ex) -> int:
    """Independent replicas while the width goes past --dp and back (`rayfree scale`): every replica's leader
    steps, each step checked. A leader whose replica drains ends (RESULT drained); one whose replica serves steps
    until it heard the newest replica (past the cluster's --dp) serve and then drain, then 10 more (RESULT
    served). Each replica callback it hears is said (HEARD); its tenth step too (STEPPED). Replica 0's engine
    asks for the widths RF_ENGINE_SCALES names (EngineScales)."""
    from rayfree import ReplicaDrained

    epoch, seen = ex.parallel_config.replica_epoch, []
    newest = int(os.environ.get("RF_NEWEST", "2"))

    def heard(k: int, st: Any) -> None:
        seen.append([k, st.state, st.epoch])
        say("HEARD", by=ex.dp_rank, replica=k, state=st.state, epoch=st.epoch)

    ex.register_replica_callback(heard)
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, t=time.monotonic())
    steps = equal = 0
    until = time.monotonic() + 300
    outcome, refused = "served", ""
    scales = EngineScales(ex)
    while time.monotonic() < until and not ([newest, "drained"] in [s[:2] for s in seen] and ex.dp_rank != newest):
        batch = make_batch(steps, replica=ex.dp_rank)
        try:
            equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
        except ReplicaDrained as e:
            outcome, refused = "drained", str(e)
            break
        steps += 1
        if steps == 10:
            say("STEPPED", replica=ex.dp_rank, steps=steps)
        scales.poll()
    for _ in range(10 if outcome == "served" else 0):
        batch = make_batch(steps, replica=ex.dp_rank)
        equal += torch_equal(ex.execute_model(batch), reference_forward(batch["x"]))
        steps += 1
    states = {k: [v.state, v.epoch] for k, v in ex.replica_states().items()}
    say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome=outcome, steps=steps, equal=equal, seen=seen,
        states=states, widths=list(ex.replica_widths()), refused=refused, asked=scales.asked)  # fmt: skip
    return 0


class EngineScales:
    """The engine's side of a scale (`scale_replicas`), as a test drives it: with RF_ENGINE_SCALES (a path),
    replica 0's engine asks, between its steps, for the width that file holds each time it changes, and says the
    answer (ASKED)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.path = os.environ.get("RF_ENGINE_SCALES", "") if ex.dp_rank == 0 else ""
        self.asked: list[str] = []
        self._last = ""

    def poll(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                want = f.read().strip()
        except OSError:  # (none asked yet)
            return
        if want and want != self._last:
            self._last = want
            self.asked.append(self.ex.scale_replicas(int(want)))
            say("ASKED", width=int(want), answer=self.asked[-1])


def coupled_batch(step: int, replica: int) -> dict:
    """The toy's batch, whose sum is 10**replica: a step's all-reduced sum across replicas names its members."""

    batch = make_batch(step, replica=replica)
    x = batch["x"]
    x[0, 0] += 10.0**replica - x.sum()
    return batch


def members_of(total: float) -> list[int]:
    return [k for k in range(6) if int(round(total)) // 10**k % 10 == 1]


def coupled_steps(ex) -> int:
    """Coupled DP replicas: toy steps, each checked (the output against the model in one process; the members
    its all-reduce across replicas summed); a step that meets a change of the replicas (ReplicasChanged) runs
    again. A first incarnation steps until it has taken RF_AFTER steps across every replica again after taking
    some across fewer (a shrink, then a grow); a replica that rejoined, RF_AFTER steps across every replica. A
    replica drained meanwhile (`rayfree scale`) says so and ends."""
    from rayfree import ReplicaDrained, ReplicasChanged

    dp, want = ex.parallel_config.data_parallel_size, int(os.environ.get("RF_AFTER", "20"))
    epoch, everyone = ex.parallel_config.replica_epoch, list(range(dp))
    hooks: list = []
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, t=time.monotonic())
    steps = equal = 0
    runs: list = []  # [members, count, first step's end time]
    changes: list = []
    until = time.monotonic() + 240
    while time.monotonic() < until:
        shrunk = any(len(r[0]) < dp for r in runs)
        if runs and runs[-1][0] == everyone and runs[-1][1] >= want and (shrunk or epoch > 0):
            break
        try:
            same, members = checked_step(ex, steps)
        except ReplicasChanged as e:
            changes.append([e.epoch, e.members, time.monotonic()])
            continue
        except ReplicaDrained as e:
            say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome="drained", steps=steps, equal=equal, runs=runs,
                refused=str(e))  # fmt: skip
            return 0
        equal += same
        steps += 1
        if runs and runs[-1][0] == members:
            runs[-1][1] += 1
        else:
            runs.append([members, 1, time.monotonic()])
            said = "ACROSS" if members == everyone else "SHRUNK" if len(members) < dp and epoch == 0 else ""
            if said:  # (the test acts on these)
                say(said, replica=ex.dp_rank, members=members, t=runs[-1][2])
    hooks = ex.collective_rpc("hook_calls", unique_reply_rank=0, timeout=60)
    halves = ex.collective_rpc("device_halves", unique_reply_rank=0, timeout=60)
    checks = ex.collective_rpc("group_checks", timeout=60)  # (every rank's: TP's second rank sums too)
    say("RESULT", replica=ex.dp_rank, epoch=epoch, steps=steps, equal=equal, runs=runs, changes=changes,
        hooks=hooks, halves=halves, checks=checks,
        states={k: [v.state, v.epoch] for k, v in ex.replica_states().items()})  # fmt: skip
    return 0


def checked_step(ex, step: int) -> tuple[int, list[int]]:
    """One toy step of coupled replicas: 1 if its output is the model's in one process, and the replicas its sum
    across replicas names (ReplicasChanged and ReplicaDrained pass through)."""

    batch = coupled_batch(step, ex.dp_rank)
    out = ex.execute_model(batch)
    total = ex.collective_rpc("step_report", unique_reply_rank=0, timeout=60)["dp_sum"]
    return torch_equal(out, reference_forward(batch["x"])), members_of(total)


def coupled_widening(ex) -> int:
    """Coupled replicas while the width goes past --dp to 3 and back (asked by replica 0's engine, EngineScales):
    each leader steps, every step checked; a step that meets a change of the members runs again. Replicas 0 and 1
    step until their groups across replicas went [0, 1] -> [0, 1, 2] -> [0, 1], then RF_AFTER more; replica 2
    (the scale-out's) steps until it drains. Each new member set is said (MEMBERS)."""
    from rayfree import ReplicaDrained, ReplicasChanged

    want, epoch = int(os.environ.get("RF_AFTER", "20")), ex.parallel_config.replica_epoch
    steps = equal = 0
    runs: list = []  # [members, count]
    changes: list = []
    outcome, refused = "served", ""
    until = time.monotonic() + 240
    scales = EngineScales(ex)
    say("STEPPING", replica=ex.dp_rank, epoch=epoch, t=time.monotonic())
    while time.monotonic() < until:
        if [r[0] for r in runs][-3:] == [[0, 1], [0, 1, 2], [0, 1]] and runs[-1][1] >= want:
            break
        scales.poll()
        try:
            same, members = checked_step(ex, steps)
        except ReplicasChanged as e:
            changes.append([e.epoch, e.members])
            continue
        except ReplicaDrained as e:
            outcome, refused = "drained", str(e)
            break
        equal += same
        steps += 1
        if runs and runs[-1][0] == members:
            runs[-1][1] += 1
        else:
            runs.append([members, 1])
            say("MEMBERS", replica=ex.dp_rank, members=members)
    hooks = ex.collective_rpc("hook_calls", unique_reply_rank=0, timeout=60) if outcome == "served" else []
    say("RESULT", replica=ex.dp_rank, epoch=epoch, outcome=outcome, steps=steps, equal=equal, runs=runs,
        changes=changes, hooks=hooks, refused=refused, asked=scales.asked)  # fmt: skip
    return 0


def torch_equal(a: Any, b: Any) -> int:

    return int(torch.equal(a, b))


def serve(ex) -> int:
    """Stay up until killed (the leader-loss test)."""
    say("SERVING", pids=[w.proc.pid for w in ex.workers])
    stop = threading.Event()
    stop.wait(int(os.environ.get("RF_SERVE_S", "300")))
    return 0


def idle(ex) -> int:
    """An engine idle between requests: one call, then it sleeps, not calling the executor and with no failure
    callback (the restart contract's test takes a node away under it)."""
    ex.collective_rpc("check_health", timeout=60)
    say("SERVING", pids=[w.proc.pid for w in ex.workers], t=time.monotonic())
    time.sleep(float(os.environ.get("RF_SERVE_S", "120")))
    say("WOKE", t=time.monotonic())
    return 0


def quick(ex) -> int:
    """A few steps (start-order tests)."""

    for s in range(3):
        ex.execute_model(make_batch(s))
    say("RESULT", ok=True)
    return 0


def outsiders(ex) -> int:
    """Run an outsider against every TCP endpoint of this 2-node cluster while the engine steps."""
    import subprocess
    import sys

    from rayfree.transport.secure.policy import process_secret

    remote = [r for r in range(ex.world_size) if ex.parallel_config.node_of(r) != 0]
    spec = {
        "pub": [ex.rpc_broadcast_mq.handle.remote_endpoint]
        + [ex.response_mqs[r].handle.remote_endpoint for r in remote],
        "router": [ex.liveness.beater.endpoint],
        "server_key": process_secret().server_public.decode(),
        "seconds": 3,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYFREE_")}
    out = subprocess.Popen(
        [sys.executable, "-m", "tests.support.outsider", json.dumps(spec)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert out.stdout is not None and out.stdout.readline().strip() == "STARTED"
    steps = equal = 0
    while out.poll() is None and steps < 2000:  # the engine keeps stepping while the outsider tries
        equal += torch.equal(ex.execute_model(make_batch(steps)), reference_forward(make_batch(steps)["x"]))
        steps += 1
    report = json.loads(out.stdout.read().split("REPORT:", 1)[1])
    out.wait(30)
    after = [torch.equal(ex.execute_model(make_batch(s)), reference_forward(make_batch(s)["x"])) for s in range(20)]
    say("RESULT", endpoints=spec, report=report, steps=steps, equal=int(equal), after=sum(after), failed=ex.is_failed)
    return 0


def dp_check(ex) -> int:
    """One DP replica's leader: its own batches through its ranks, the cross-replica all-reduce, its topology."""

    dp = ex.parallel_config.data_parallel_size
    par = ex.parallel_config
    across = par.one_world or par.coupled  # (independent replicas have no DP group across them: nothing summed)
    steps = equal = dp_ok = 0
    for s in range(20):
        batch = make_batch(s, replica=ex.dp_rank)
        equal += torch.equal(ex.execute_model(batch), reference_forward(batch["x"]))
        got = ex.collective_rpc("step_report", unique_reply_rank=ex.output_rank)["dp_sum"]
        dp_ok += got == (dp_sum(s, dp) if across else 0.0)
        steps += 1
    info = ex.collective_rpc(where, timeout=60)
    sizes = ex.collective_rpc(groups, timeout=60)
    say("RESULT", replica=ex.dp_rank, steps=steps, equal=int(equal), dp_ok=int(dp_ok), info=info, groups=sizes)
    return 0


def calls_then_serve(ex) -> int:
    """RF_CALLS steps, then stay up until stopped (the metrics test scrapes in between)."""

    n = int(os.environ.get("RF_CALLS", "25"))
    for s in range(n):
        ex.execute_model(make_batch(s))
    say("CALLED", calls=n)
    threading.Event().wait(int(os.environ.get("RF_SERVE_S", "300")))
    return 0


def busy(ex) -> int:
    """Calls always in flight (each a short nap on every rank) until the cluster fails or stops: the health
    probes' test stops a rank, a worker or a node under it."""
    from rayfree import ExecutorError

    ex.collective_rpc(nap, args=(0.0,), timeout=60)
    say("SERVING", pids=[w.proc.pid for w in ex.workers])
    try:
        while True:
            ex.collective_rpc(nap, args=(0.05,))
    except ExecutorError as e:
        say("FAILED", error=str(e).split("\n")[0], t=time.monotonic())
        return 1


def payload_len(worker: Any, payload: bytes) -> int:
    return len(payload)


def _tx_bytes() -> int:
    """Bytes this node has put on its cable (`ip netns exec` shows the node's own /sys/class/net)."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def relay_bytes(ex) -> int:
    """The toy engine equals the 1-process model; then 1 MiB broadcasts, and the bytes node 0 sent for each;
    the relays as node 0 sees them (their parents, children and bytes)."""

    steps = 20
    equal = sum(
        torch.equal(ex.execute_model(make_batch(s)), reference_forward(make_batch(s)["x"])) for s in range(steps)
    )
    size, n = 1 << 20, 20
    payload = os.urandom(size)
    for _ in range(3):  # warm: every path has carried a big message
        ex.collective_rpc(payload_len, args=(payload,), timeout=60)
    before = _tx_bytes()
    lens = [ex.collective_rpc(payload_len, args=(payload,), timeout=60) for _ in range(n)]
    per_broadcast = (_tx_bytes() - before) / n / size
    from rayfree.cluster.relay_tree import runs_relay
    from rayfree.transport.secure.policy import process_secret

    cfg = ex.config
    expect = 0 if cfg.broadcast == "flat" else sum(runs_relay(cfg, k) for k in range(1, cfg.parallel.nnodes))
    relays = []
    deadline = time.monotonic() + 10  # statuses ride on heartbeats: wait for one taken after the broadcasts
    while time.monotonic() < deadline:
        from rayfree.executor.status_messages import cluster_status

        nodes = cluster_status(ex.liveness).nodes
        relays = [
            dict(node=s.node, ip=s.ip, **{k: getattr(r, k) for k in r.__struct_fields__})
            for s in nodes
            for r in s.relays
        ]
        if len(relays) == expect and all(r["relayed"] >= n + 3 + steps for r in relays):
            break
        time.sleep(0.05)
    say(
        "RESULT",
        steps=steps,
        equal=int(equal),
        lens_ok=all(x == [size] * ex.world_size for x in lens),
        copies=per_broadcast,
        relays=relays,
        info=ex.collective_rpc(where, timeout=60),
        sealed=process_secret() is not None,
    )
    return 0


def _threads(worker: Any) -> list[str]:
    from rayfree.supervisor import supervisor

    return sorted(t.name for t in supervisor().threads())


def threads(ex) -> int:
    """Every process's supervised threads: this node's, every worker's, and the other nodes' (from their status,
    as `rayfree status` shows it)."""
    from rayfree.executor.status_messages import cluster_status

    ex.collective_rpc("check_health", timeout=60)
    workers = {str(r): names for r, names in enumerate(ex.collective_rpc(_threads, timeout=60))}
    deadline = time.monotonic() + 10  # the followers' statuses ride on their heartbeats: one sent once ready
    nodes: dict[str, list[str]] = {}
    while time.monotonic() < deadline:
        st = cluster_status(ex.liveness).nodes
        nodes = {str(n.node): n.threads for n in st}
        if all(n.state == "ok" and n.threads for n in st):
            break
        time.sleep(0.1)
    say("THREADS", nodes=nodes, workers=workers)
    return 0
