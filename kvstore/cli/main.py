"""The ``kvstore`` console script.

Each subcommand lives in the module that owns its work and registers itself here
through ``add_parser(subparsers)``; this file only routes, renders errors as one
line plus a hint, and sets exit codes. Every command takes ``--json``.

The store's own commands are imported here. The serving commands are not: they are
named in kvstore/cli/extensions.py and their module is imported only when one of them
runs (or when a caller asks for them by name), so ``pip install kvstore`` with no extras
starts, serves and administers a store without torch or an ASGI stack.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Sequence

from kvstore.cli.extensions import EXTENSIONS, MissingExtra, extension_for, load_extension
from kvstore.errors import KVStoreError

__all__ = ["build_parser", "main"]


def build_parser(load_commands: Collection[str] = ()) -> argparse.ArgumentParser:
    """The parser with every store command, and the extension commands in ``load_commands``
    fully defined (their modules imported). Other extension commands are listed by name
    and help only; :func:`main` loads the one that is run."""
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A tiered, distributed KV-cache store for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from kvstore.cli import admin, cluster
    from kvstore.server import serve as server

    server.add_parser(sub)
    cluster.add_parser(sub)
    admin.add_parser(sub)
    defined: set[str] = set()
    for ext in EXTENSIONS:
        if ext.command in load_commands and ext.module not in defined:
            load_extension(ext).add_parser(sub)
            defined.add(ext.module)
    registered = set(sub.choices)
    for ext in EXTENSIONS:
        if ext.command not in registered:
            stub = sub.add_parser(ext.command, help=ext.help, add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    try:
        ext = extension_for(command)
        parser = build_parser(load_commands=(ext.command,) if ext else ())
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1
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
