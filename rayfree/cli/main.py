"""The `rayfree` command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("rayfree")
    except PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rayfree", description="Run an LLM engine's workers across processes and nodes without Ray."
    )
    p.add_argument("--version", action="version", version=f"rayfree {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "demo",
        help="run the toy engine on two simulated nodes and print step latencies",
        description="Runs the toy TP x PP engine (rayfree/cli/toy_engine.py) on two simulated nodes of "
        "this machine (own network namespace, IP and /dev/shm each when root; loopback "
        "otherwise), checks every output against the single-process model, and prints "
        "the topology and step latencies. --nodes 1 runs it in this process; "
        "--transport runs the transport-only demo instead.",
    )
    d.add_argument(
        "--nodes", type=int, default=None, help="simulated nodes (default 2, with --dp D: 2 x D; 1: no simulation)"
    )
    d.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    d.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 2; with --dp: 1)")
    d.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel replicas (default 1); --dp 2: two replicas of TP=2, each over two nodes",
    )
    d.add_argument("--steps", type=int, default=200, help="engine steps (default 200)")
    d.add_argument(
        "--lose-replica",
        action="store_true",
        help="with --dp 2 or more: a node of replica 1 is killed mid-run and rejoins while the others serve on",
    )
    d.add_argument("--transport", action="store_true", help="the transport demo: one writer, shm and TCP readers")
    d.add_argument("--readers", type=int, default=3, help="--transport: local readers (default 3)")
    d.add_argument("--remote", type=int, default=1, help="--transport: remote readers over TCP (default 1)")
    d.add_argument("--messages", type=int, default=300, help="--transport: messages (default 300)")
    k = sub.add_parser(
        "keygen",
        help="write a new cluster secret file (mode 0600)",
        description="Writes a new random cluster secret to FILE (which must not exist), readable by "
        "its owner only. Give the same file to every node: --secret-file FILE, "
        "RAYFREE_SECRET_FILE, or the compose secret rayfree_secret.",
    )
    k.add_argument("file", metavar="FILE")
    from .node_options import add_node_arguments, add_security_arguments

    n = sub.add_parser(
        "node",
        help="run one node of a cluster (node 0 with the engine's entry point)",
        description="Start this node's workers. Node 0 (the leader) also runs --entry, a function "
        "called with the executor; nodes 1..N-1 run --headless. Every option can come "
        "from the environment (RAYFREE_<OPTION>, e.g. RAYFREE_NODE_RANK) or --config "
        "FILE; flags win over the environment, which wins over the file.",
    )
    add_node_arguments(n)
    doc = sub.add_parser(
        "doctor",
        help="check what breaks multi-node runs, and say how to fix it",
        description="Checks /dev/shm space, the address and interface rayfree will use, the route "
        "to master_addr, free ports, GLOO/NCCL_SOCKET_IFNAME, and stale rayfree "
        "segments. Exit code 1 when a check fails. Reads the same options as "
        "`rayfree node`.",
    )
    doc.add_argument(
        "--quick", action="store_true", help="only the checks that take no network action (for a container healthcheck)"
    )
    doc.add_argument("--fix", action="store_true", help="remove stale segments without asking")
    doc.add_argument("--launcher", metavar="NAME", help="as `rayfree node --launcher` (default auto: detect)")
    from rayfree.cluster.loading import add_config_arguments

    add_config_arguments(doc)
    add_security_arguments(doc)
    st = sub.add_parser(
        "status",
        help="what the running cluster is doing, asked of node 0",
        description="Asks node 0, over the heartbeat channel (authenticated with the cluster "
        "secret), for every node, its ranks and workers (pid, process title, state), "
        "heartbeat ages, the calls in flight, each rank's time since its last reply and "
        "the broadcast ring's occupancy. Reads the same options as `rayfree node`.",
    )
    st.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for node 0's answer (default 5)")
    st.add_argument(
        "--ask", metavar="ADDRESS", help="ask the node at ADDRESS instead of node 0: while node 0 is lost, a "
        "replica's leader that serves on without it answers for itself",
    )  # fmt: skip
    add_config_arguments(st)
    add_security_arguments(st)
    dr = sub.add_parser(
        "drain",
        help="take an independent DP replica out of service, asked of node 0",
        description="Asks node 0 to drain DP replica REPLICA: every node marks it draining (an engine routing by "
        "replica_states() sends it nothing new), its calls in flight finish (RAYFREE_DRAIN_TIMEOUT_S at most), then "
        "its nodes stop and exit 0. Start those nodes again with the same command to bring it back (it rejoins). "
        "Reads the same options as `rayfree node`.",
    )
    dr.add_argument("replica", type=int, help="the DP replica's rank")
    dr.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for node 0's answer (default 5)")
    add_config_arguments(dr)
    add_security_arguments(dr)
    sc = sub.add_parser(
        "scale",
        help="change how many DP replicas serve, asked of node 0",
        description="`rayfree scale --dp WIDTH`: asks node 0 for WIDTH DP replicas, between 1 and the --dp the "
        "cluster was started with. "
        "Lower: the highest replicas drain (as `rayfree drain`: calls in flight finish, their nodes exit 0). "
        "Higher again: start the nodes of the replicas drained below WIDTH with the same command; they rejoin. "
        "Nodes that do not come within join_timeout_s leave the width as it was. Reads the same options as "
        "`rayfree node`.",
    )
    sc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for node 0's answer (default 5)")
    add_config_arguments(sc)
    add_security_arguments(sc)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.transport:
            from .demo import run_transport_demo

            return run_transport_demo(args.readers, args.remote, args.messages)
        nodes = args.nodes if args.nodes is not None else 2 * max(1, args.dp)
        pp = args.pp if args.pp is not None else (1 if args.dp > 1 else 2)
        if nodes <= 1:
            from .demo import run_engine_demo

            return run_engine_demo(args.tp, pp, args.steps, args.dp)
        from .cluster_demo import run_cluster_demo

        return run_cluster_demo(nodes, args.tp, pp, args.steps, args.dp, lose_replica=args.lose_replica)
    if args.command in ("doctor", "status", "drain", "scale"):  # (`rayfree node`: inside its own error handling)
        from rayfree.transport.secure.policy import SecretError

        from .node_options import apply_security_arguments

        try:
            apply_security_arguments(args)
        except SecretError as e:
            if args.command != "doctor":  # the doctor reports it among its other checks
                print(f"rayfree {args.command}: {e}", file=sys.stderr)
                return 2
            args.secret_error = e
    if args.command == "node":
        from .node import leave, run_node

        leave(run_node(args))
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(args)
    if args.command == "status":
        from .status import run_status

        return run_status(args)
    if args.command == "drain":
        from .status import run_drain

        return run_drain(args)
    if args.command == "scale":
        from .status import run_scale

        return run_scale(args)
    if args.command == "keygen":
        from rayfree.transport.secure.policy import write_secret

        try:
            write_secret(args.file)
        except FileExistsError:
            print(
                f"rayfree keygen: {args.file} exists; not overwriting a secret (delete it first to rotate)",
                file=sys.stderr,
            )
            return 2
        except OSError as e:
            print(f"rayfree keygen: cannot write {args.file}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"wrote a new cluster secret to {args.file} (mode 0600); give every node this file")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
