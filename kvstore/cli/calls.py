"""How the operator's commands call nodes: their shared flags, a client with the
token, and errors as one line plus a hint.

Used by ``stats`` and ``evict`` (kvstore/cli/admin.py), ``drain`` (kvstore/cli/drain.py)
and ``ls --tenant`` (kvstore/cli/cluster.py). A client here is a
:class:`~kvstore.client.store.NodeClient`: one server process, whatever it answers for,
since these commands act on the process (a sharded node's shards one by one,
kvstore/cli/targets.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

from kvstore.client.store import NodeClient
from kvstore.config import ClientConfig
from kvstore.errors import ConfigError, KVStoreError, PermissionDenied

__all__ = [
    "DEFAULT_NODE",
    "command",
    "connect",
    "console",
    "error",
    "guard",
    "info_of",
    "print_json",
]

DEFAULT_NODE = "127.0.0.1:7400"
_HINTS = {
    "permission_denied": "use an admin token (--token or KVSTORE_TOKEN)",
    "unauthenticated": "set KVSTORE_TOKEN (or --token) to a token from the server's tokens file",
    "unavailable": "is 'kvstore serve' running there? check --node HOST:PORT",
    "timeout": "is 'kvstore serve' running there? check --node HOST:PORT",
}


def command(sub: Any, name: str, text: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand with the flags every operator command has."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=text,
        description=text[:1].upper() + text[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--token", help="token (default: KVSTORE_TOKEN, which ps does not show)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def guard(
    name: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """Run a command; a store error is one line plus a hint and exit code 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except KVStoreError as exc:
            error(name, exc)
            return 1

    return run


def error(name: str, exc: KVStoreError, where: str = "") -> None:
    """One error line (``where``: the node it came from) and its hint, on stderr."""
    at = f" ({where})" if where else ""
    print(f"kvstore {name}: error{at}: {exc}", file=sys.stderr)
    hint = _HINTS.get(exc.code, f"see 'kvstore {name} --help'")
    print(f"hint: {hint}", file=sys.stderr)


def connect(address: str, args: argparse.Namespace, *, admin: str = "") -> NodeClient:
    """An open client of one process; with ``admin`` set, refuse a non-admin token
    early."""
    cfg = ClientConfig.load(
        token=args.token, timeout_s=args.timeout, connect_timeout_s=min(args.timeout, 5.0)
    )
    if not cfg.token:
        raise ConfigError("no token: set KVSTORE_TOKEN or pass --token")
    client = NodeClient.connect(address, config=cfg)
    info = client.server_info
    if admin and not info.get("admin", False):
        client.close()
        tenant = info.get("tenant", "?")
        raise PermissionDenied(f"{admin} needs an admin token (this one is for tenant {tenant})")
    return client


def info_of(args: argparse.Namespace, admin: str = "") -> Callable[[str], Mapping[str, Any]]:
    """What the process at an address says about itself (kvstore/cli/targets.py)."""

    def info(address: str) -> Mapping[str, Any]:
        with connect(address, args, admin=admin) as c:
            return c.server_info

    return info


def console() -> Any:
    """A rich console for tables (stdout)."""
    from rich.console import Console

    return Console(highlight=False)


def print_json(doc: Any) -> None:
    """One JSON document on stdout, for scripts."""
    print(json.dumps(doc, indent=2, sort_keys=True))
