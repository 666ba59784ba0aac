"""``kvstore stats``, ``kvstore evict`` and ``kvstore drain``: the operator's commands.

Each talks to nodes by address (``--node HOST:PORT``, default 127.0.0.1:7400) with a
token from ``--token`` or ``KVSTORE_TOKEN``. ``evict`` and ``drain`` need an admin
token, checked here first (one clear line) and again by the server; ``stats`` works with
any token, and a tenant token sees only its own tenant's per-tenant counters. Errors
are one line plus a hint, exit code 1; ``--json`` prints one document for scripts.
Tables and progress go to a rich console sized to the terminal (80 columns fit).

Nodes are named by address; naming them by node id needs the cluster directory
(kvstore/client/cluster.py) and is not wired here yet. A drain of a clustered node
marks its directory record ``draining`` before the call returns (``kvstore nodes``
shows it), so cluster clients put elsewhere while its blocks move out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from kvstore.cli.stats_view import count, render, summarize
from kvstore.client import StoreClient
from kvstore.client.admin import AdminClient
from kvstore.config import ClientConfig, parse_size
from kvstore.errors import ConfigError, InvalidValue, KVStoreError, PermissionDenied
from kvstore.observe.fmt import fmt_bytes

__all__ = ["add_parser", "connect", "parse_duration", "parse_target"]

DEFAULT_NODE = "127.0.0.1:7400"
_HINTS = {
    "permission_denied": "use an admin token (--token or KVSTORE_TOKEN)",
    "unauthenticated": "set KVSTORE_TOKEN (or --token) to a token from the server's tokens file",
    "unavailable": "is 'kvstore serve' running there? check --node HOST:PORT",
    "timeout": "is 'kvstore serve' running there? check --node HOST:PORT",
}
_STATS_EXAMPLE = """\
examples:
  KVSTORE_TOKEN=... kvstore stats --node 127.0.0.1:7400 --node 127.0.0.1:7402
  kvstore stats --tenant acme --json | jq '.nodes[].hit_rate'
"""
_EVICT_EXAMPLE = """\
examples:
  kvstore evict --tier dram --to 70%            # demote LRU blocks to SSD until 70% full
  kvstore evict --tier ssd --bytes 10GiB --tenant acme --dry-run
  kvstore evict --tier ssd --namespace llama-3-8b --older-than 2h

Pinned blocks (being read) are never evicted; the command says how many it skipped.
--prefix matches stored keys as 'kvstore ls' shows them (tenant-scoped hashes).
--tenant/--namespace select blocks written with a model scope (names kept beside the
SSD tier across restarts, and carried along by 'kvstore drain').
"""
_DRAIN_EXAMPLE = """\
examples:
  kvstore drain 127.0.0.1:7402 --to 127.0.0.1:7400   # move every block, then empty
  kvstore drain 127.0.0.1:7402 --drop                # just drop them (it is a cache)
  kvstore drain 127.0.0.1:7402 --undo                # take writes again
"""


def add_parser(sub: Any) -> None:
    """Register ``stats``, ``evict`` and ``drain``."""
    p = _command(
        sub, "stats", "per node and tier: capacity, use, hits, moves, bytes", _STATS_EXAMPLE
    )
    p.add_argument("--node", action="append", metavar="ADDR", help="HOST:PORT (repeatable)")
    p.add_argument("--tenant", help="show this tenant's hits, misses, puts and bytes")
    p.set_defaults(func=_guard("stats", _cmd_stats))

    p = _command(sub, "evict", "evict blocks from a tier (admin)", _EVICT_EXAMPLE)
    p.add_argument("--node", action="append", metavar="ADDR", help="HOST:PORT (repeatable)")
    p.add_argument("--tier", required=True, choices=("hbm", "dram", "ssd"), help="tier to evict")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--to", metavar="FILL", help="leave the tier at most this full: 70%% or 2GiB"
    )
    target.add_argument("--bytes", metavar="N", help="free at least N bytes (e.g. 512MiB)")
    p.add_argument("--tenant", default="", help="only this tenant's blocks")
    p.add_argument("--namespace", default="", metavar="MODEL", help="only this model's blocks")
    p.add_argument("--prefix", default="", metavar="HEX", help="only stored keys with this prefix")
    p.add_argument("--older-than", metavar="AGE", help="only blocks unused for AGE (30s, 10m, 2h)")
    p.add_argument("--dry-run", action="store_true", help="show what would go; move nothing")
    p.add_argument("--list", type=int, default=10, metavar="K", help="blocks listed (dry run)")
    p.set_defaults(func=_guard("evict", _cmd_evict))

    p = _command(
        sub, "drain", "move or drop a node's blocks so it can leave (admin)", _DRAIN_EXAMPLE
    )
    p.add_argument("address", metavar="ADDR", help="HOST:PORT of the node to drain")
    p.add_argument(
        "--to", action="append", default=[], metavar="ADDR", help="node to move blocks to"
    )
    p.add_argument("--drop", action="store_true", help="drop blocks that have nowhere to go")
    p.add_argument("--undo", action="store_true", help="end a drain: take writes again")
    p.set_defaults(func=_guard("drain", _cmd_drain))


def _command(sub: Any, name: str, text: str, epilog: str) -> argparse.ArgumentParser:
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


# -- plumbing ----------------------------------------------------------------------------


def _guard(
    name: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """Run a command; a store error is one line plus a hint and exit code 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except KVStoreError as exc:
            _error(name, exc)
            return 1

    return run


def _error(name: str, exc: KVStoreError, where: str = "") -> None:
    at = f" ({where})" if where else ""
    print(f"kvstore {name}: error{at}: {exc}", file=sys.stderr)
    hint = _HINTS.get(exc.code, f"see 'kvstore {name} --help'")
    print(f"hint: {hint}", file=sys.stderr)


def connect(
    address: str, args: argparse.Namespace, *, admin: str = "", whole_node: bool = True
) -> StoreClient:
    """An open client of one node; with ``admin`` set, refuse a non-admin token early.
    ``whole_node=False``: of the dialled server alone, even if it is shard 0 of a
    sharded node (for commands that walk the directory, where each shard is a node)."""
    cfg = ClientConfig.load(
        token=args.token, timeout_s=args.timeout, connect_timeout_s=min(args.timeout, 5.0)
    )
    if not cfg.token:
        raise ConfigError("no token: set KVSTORE_TOKEN or pass --token")
    client = StoreClient.connect(address, config=cfg, whole_node=whole_node)
    info = client.server_info
    if admin and not info.get("admin", False):
        client.close()
        tenant = info.get("tenant", "?")
        raise PermissionDenied(f"{admin} needs an admin token (this one is for tenant {tenant})")
    return client


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


# -- stats -------------------------------------------------------------------------------


def _cmd_stats(args: argparse.Namespace) -> int:
    docs, errors = [], []
    for address in args.node or [DEFAULT_NODE]:
        try:
            with connect(address, args) as c:
                info = c.server_info
                if args.tenant and args.tenant != info.get("tenant") and not info.get("admin"):
                    raise PermissionDenied("a tenant token reads only its own tenant's stats")
                docs.append(summarize(address, c.stats(), args.tenant))
        except KVStoreError as exc:
            errors.append({"node": address, "code": exc.code, "error": str(exc)})
            if not args.json:
                _error("stats", exc, address)
    if args.json:
        _print_json({"nodes": docs, "errors": errors})
    else:
        console = _console()
        for i, doc in enumerate(docs):
            if i:
                console.print()
            render(console, doc)
    return 1 if errors else 0


# -- evict -------------------------------------------------------------------------------


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(text: str) -> float:
    """``"10m"`` -> 600.0 seconds (ms, s, m, h, d; a bare number is seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise ConfigError(f"--older-than {text!r}: expected a duration like 30s, 10m or 2h")
    return float(m[1]) * _SECONDS[m[2]]


def parse_target(to: str | None, free: str | None, used: int, capacity: int) -> int:
    """The byte target of an eviction: ``--to 70%`` / ``--to 2GiB`` (the fill to leave),
    ``--bytes N`` (how much to free), or neither (0: every matching block)."""
    if to is not None:
        text = to.strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise ConfigError(f"--to {to!r}: expected a percentage like 70%") from None
            if not 0 <= pct <= 100:
                raise ConfigError(f"--to {to!r}: a percentage is 0% to 100%")
            return int(capacity * pct / 100)
        return parse_size(text, "--to")
    if free is not None:
        return max(used - parse_size(free, "--bytes"), 0)
    return 0


def _cmd_evict(args: argparse.Namespace) -> int:
    filters = args.tenant or args.namespace or args.prefix or args.older_than
    if args.to is None and args.bytes is None and not filters:
        raise ConfigError(
            "say what to evict: --to 70%, --bytes N or a filter (--tenant, --namespace, "
            "--prefix, --older-than); --to 0% empties the tier"
        )
    try:
        prefix = bytes.fromhex(args.prefix)
    except ValueError:
        raise ConfigError(f"--prefix {args.prefix!r}: expected hex digits, in pairs") from None
    idle = parse_duration(args.older_than) if args.older_than else 0.0
    results, status = [], 0
    for address in args.node or [DEFAULT_NODE]:
        try:
            with connect(address, args, admin="evict") as c:
                tier = c.stats()["tiers"].get(args.tier)
                if tier is None:
                    raise InvalidValue(f"node {address} has no {args.tier} tier")
                target = parse_target(args.to, args.bytes, int(tier["used"]), int(tier["capacity"]))
                r = AdminClient(c).evict(
                    args.tier,
                    target,
                    tenant=args.tenant,
                    model=args.namespace,
                    key_prefix=prefix,
                    idle_s=idle,
                    dry_run=args.dry_run,
                    list_limit=max(args.list, 0) if args.dry_run or args.json else 0,
                )
                r.update(node=address, node_id=c.server_info.get("node_id", ""), target=target)
                results.append(r)
        except KVStoreError as exc:
            status = 1
            _error("evict", exc, address)
    if args.json:
        _print_json({"results": results})
    else:
        for r in results:
            _print_evict(r)
    return status


def _print_evict(r: dict[str, Any]) -> None:
    """A few short lines per node (they fit 80 columns)."""
    verb = "would evict" if r["dry_run"] else "evicted"
    what = f"{verb} {r['moved']} blocks ({fmt_bytes(r['bytes'])})"
    print(f"{r['node_id']} {r['node']} · {r['tier']}: {what}")
    n = r["skipped_pinned"]
    moves = f"{r['demoted']} demoted to {r['next_tier']}, " if r["next_tier"] else ""
    print(f"  {moves}{r['dropped']} dropped; skipped {n} pinned block{'s' if n != 1 else ''}")
    after = "would be" if r["dry_run"] else "now"
    print(
        f"  used {fmt_bytes(r['used_before'])}, {after} {fmt_bytes(r['used_after'])} "
        f"(target {fmt_bytes(r['target'])} of {fmt_bytes(r['capacity'])})"
    )
    if r["used_after"] > r["target"]:
        print("  target not reached: the rest is pinned or outside the filters")
    if r["dry_run"] and r["blocks"]:
        for b in r["blocks"]:
            print(f"    {b['key']}  {fmt_bytes(b['size'])}")
        if r["moved"] > len(r["blocks"]):
            print(f"    ... and {count(r['moved'] - len(r['blocks']))} more (--list K)")


# -- drain -------------------------------------------------------------------------------


def _cmd_drain(args: argparse.Namespace) -> int:
    from kvstore.client.drain import drain_node

    with connect(args.address, args, admin="drain") as source:
        if args.undo:
            source.set_draining(False)
            print(f"{args.address}: takes writes again", file=sys.stderr)
            if args.json:
                _print_json({"node": args.address, "draining": False})
            return 0
        if not args.to and not args.drop:
            raise ConfigError("give --to ADDR to move the blocks, or --drop to drop them")
        targets = [connect(a, args, admin="drain") for a in args.to]
        try:
            if args.json:
                report = drain_node(source, targets, drop=args.drop)
            else:
                report = _drain_with_progress(drain_node, source, targets, args)
        finally:
            for t in targets:
                t.close()
    doc = {"node": args.address, "draining": True, **_asdict(report)}
    if args.json:
        _print_json(doc)
    else:
        _print_drain(doc)
    return 0 if report.remaining == 0 else 1


def _drain_with_progress(
    drain: Any, source: StoreClient, targets: list[StoreClient], args: argparse.Namespace
) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("drain {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("blocks {task.fields[nbytes]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(args.address, total=None, nbytes="")

        def update(done: int, nbytes: int, total: int) -> None:
            bar.update(task, completed=done, total=total, nbytes=fmt_bytes(nbytes))

        return drain(source, targets, drop=args.drop, progress=update)


def _asdict(report: Any) -> dict[str, Any]:
    return {name: getattr(report, name) for name in report.__slots__}


def _print_drain(doc: dict[str, Any]) -> None:
    """The drain's outcome in short lines (they fit 80 columns)."""
    print(f"drained {doc['node_id']} {doc['node']}: {doc['remaining']} blocks left")
    to = ", ".join(f"{n} to {node}" for node, n in doc["per_target"].items())
    print(
        f"  moved {doc['moved']} blocks ({fmt_bytes(doc['moved_bytes'])}){': ' + to if to else ''}"
        f"; {doc['already_there']} were there already"
    )
    print(f"  dropped {doc['dropped']} blocks ({fmt_bytes(doc['dropped_bytes'])})")
    for why in doc["errors"]:
        print(f"    because: {why}")
    print(f"  it takes no writes until restarted or: kvstore drain {doc['node']} --undo")
