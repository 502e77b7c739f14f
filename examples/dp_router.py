"""An engine that routes requests over independent DP replicas, and around a lost one (docs/engines.md).

One process runs every replica (`rayfree.NodeReplicas`: one node, `--dp D`). Each request goes to the next
replica that serves; one whose replica is lost on the way (`ReplicaLost`) is sent again to another. What a
request had generated is the engine's own to move (here a request is one whole call, so it is simply sent
again); rayfree gives the typed error, the replicas' states and a callback when one changes.
"""

from __future__ import annotations

from itertools import count

from rayfree import ReplicaLost

turns = count()


def submit(executors, method, *args):  # executors: {dp_rank: executor}, as NodeReplicas(...).leaders gives them
    """Rank 0's reply to `method(*args)` from the next replica that serves; sent again if that one is lost."""
    while True:
        states = next(iter(executors.values())).replica_states()
        live = [k for k in sorted(executors) if states[k].state == "serving"]
        if not live:
            raise RuntimeError("no DP replica serves")
        k = live[next(turns) % len(live)]
        try:
            return k, executors[k].collective_rpc(method, args=args, unique_reply_rank=0, timeout=60)
        except ReplicaLost:
            continue  # lost on the way: send it again, to another replica


def main() -> int:
    """Two replicas of TP=2 on this machine; 200 requests; replica 1 loses a worker (SIGKILL) after 50."""
    import os
    import signal

    from rayfree import ClusterConfig, NodeReplicas, ParallelConfig
    from rayfree.transport import get_open_port

    par = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, master_port=get_open_port("127.0.0.1"))
    replicas = NodeReplicas(ClusterConfig(parallel=par), "echo_worker:EchoWorker", {"distributed": True})
    try:
        executors = {ex.dp_rank: ex for ex in replicas.leaders}
        heard: list[tuple[int, str]] = []
        executors[0].register_replica_callback(lambda k, state: heard.append((k, state.state)))
        answered = {0: 0, 1: 0}
        after = {0: 0, 1: 0}  # answered after the loss was heard of
        for i in range(200):
            if i == 50:
                os.kill(executors[1].workers[1].proc.pid, signal.SIGKILL)
            known = bool(heard)
            k, got = submit(executors, "echo", i)
            assert got == i, (i, got)
            answered[k] += 1
            after[k] += known
        states = {k: s.state for k, s in executors[0].replica_states().items()}
        print(f"200 requests answered, each once: replica 0 took {answered[0]}, replica 1 took {answered[1]}")
        print(f"once its loss was heard of: replica 0 took {after[0]}, replica 1 took {after[1]}")
        print(f"replica changes heard: {heard}; states now: {states}")
    finally:
        replicas.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
