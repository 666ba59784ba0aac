"""The ``kvstore`` console script.

Each subcommand lives in the module that owns its work and registers itself here
through ``add_parser(subparsers)``; this file only routes, renders errors as one
line plus a hint, and sets exit codes. Every command takes ``--json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A tiered, distributed KV-cache store for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from engine import demo_cli, plan
    from engine.serving import cli as serving
    from kvstore.cli import admin, cluster
    from kvstore.server import serve as server

    demo_cli.add_parser(sub)
    server.add_parser(sub)
    cluster.add_parser(sub)
    plan.add_parser(sub)
    admin.add_parser(sub)
    serving.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        print(
            f"hint: run 'kvstore {args.command} --help' (error code: {exc.code})", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
