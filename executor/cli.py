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
        prog="rayfree",
        description="Run an LLM engine's workers across processes and nodes without Ray.")
    p.add_argument("--version", action="version", version=f"rayfree {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("demo", help="run the toy engine on 4 workers and print step latencies",
                       description="Runs the toy TP x PP engine (examples/toy_engine.py) under a "
                                   "MultiprocExecutor, checks every output against the single-process model, "
                                   "and prints step latency and the executor's own overhead per step. "
                                   "--transport runs the transport-only demo instead.")
    d.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    d.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    d.add_argument("--steps", type=int, default=300, help="engine steps (default 300)")
    d.add_argument("--transport", action="store_true", help="the transport demo: one writer, shm and TCP readers")
    d.add_argument("--readers", type=int, default=3, help="--transport: local readers (default 3)")
    d.add_argument("--remote", type=int, default=1, help="--transport: remote readers over TCP (default 1)")
    d.add_argument("--messages", type=int, default=300, help="--transport: messages (default 300)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.transport:
            from .demo import run_transport_demo
            return run_transport_demo(args.readers, args.remote, args.messages)
        from .demo import run_engine_demo
        return run_engine_demo(args.tp, args.pp, args.steps)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
