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
    d = sub.add_parser("demo", help="broadcast messages to reader processes and print a summary",
                       description="Transport demo: one writer, local readers over shared memory and "
                                   "one remote reader over TCP (127.0.0.1), each in its own process.")
    d.add_argument("--readers", type=int, default=3, help="local readers (default 3)")
    d.add_argument("--remote", type=int, default=1, help="remote readers over TCP (default 1)")
    d.add_argument("--messages", type=int, default=300, help="messages to broadcast (default 300)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_transport_demo
        return run_transport_demo(args.readers, args.remote, args.messages)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
