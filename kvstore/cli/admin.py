"""``kvstore stats`` and ``kvstore evict``: the operator's commands (``kvstore drain``
is kvstore/cli/drain.py, registered with them).

Each talks to nodes by address (``--node HOST:PORT``, default 127.0.0.1:7400) with a
token from ``--token`` or ``KVSTORE_TOKEN``. ``evict`` needs an admin token, checked
here first (one clear line) and again by the server; ``stats`` works with any token,
and a tenant token sees only its own tenant's per-tenant counters. Errors are one line
plus a hint, exit code 1; ``--json`` prints one document for scripts. Tables and
progress go to a rich console sized to the terminal (80 columns fit).

``stats`` also names nodes as the directory does (``--node NAME``, or every node of
the cluster with ``--etcd``/``--cluster`` and no ``--node``), and shows a node served
by ``kvstore serve --shards N`` (named by its name or its address) as the node's
totals followed by each shard (kvstore/cli/targets.py, stats_view.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from kvstore.cli import drain
from kvstore.cli.calls import DEFAULT_NODE, command, connect, console, error, guard, print_json
from kvstore.cli.directory import add_directory_flags, read
from kvstore.cli.stats_view import combine, count, render, render_shards, summarize
from kvstore.cli.targets import Target, every_node, from_directory, from_info, is_address
from kvstore.client.admin import AdminClient
from kvstore.config import parse_size
from kvstore.errors import ConfigError, InvalidValue, KVStoreError, PermissionDenied
from kvstore.observe.fmt import fmt_bytes

__all__ = ["add_parser", "connect", "parse_duration", "parse_target"]

_STATS_EXAMPLE = """\
examples:
  KVSTORE_TOKEN=... kvstore stats --node 127.0.0.1:7400 --node 127.0.0.1:7402
  kvstore stats --tenant acme --json | jq '.nodes[].hit_rate'
  kvstore stats --etcd 127.0.0.1:2379 --cluster c1    # every node of the cluster
  kvstore stats --node n1 --etcd 127.0.0.1:2379       # one node by name

A sharded node ('kvstore serve --shards N') shows its totals, then each shard; in
--json, "nodes" has one entry per shard and "groups" the totals.
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


def add_parser(sub: Any) -> None:
    """Register ``stats``, ``evict`` and ``drain``."""
    p = command(
        sub, "stats", "per node and tier: capacity, use, hits, moves, bytes", _STATS_EXAMPLE
    )
    p.add_argument(
        "--node", action="append", metavar="NODE", help="HOST:PORT or node name (repeatable)"
    )
    p.add_argument("--tenant", help="show this tenant's hits, misses, puts and bytes")
    add_directory_flags(p)
    p.set_defaults(func=guard("stats", _cmd_stats))

    p = command(sub, "evict", "evict blocks from a tier (admin)", _EVICT_EXAMPLE)
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
    p.set_defaults(func=guard("evict", _cmd_evict))

    drain.add_parser(sub)


# -- stats -------------------------------------------------------------------------------


def _cmd_stats(args: argparse.Namespace) -> int:
    docs: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    shown: list[tuple[dict[str, Any] | None, list[dict[str, Any]]]] = []
    for target in _stats_targets(args, errors):
        mine = [d for p in target.processes if (d := _node_stats(args, p.address, errors))]
        for name in target.missing:
            errors.append({"node": name, "code": "unavailable", "error": "not registered"})
            if not args.json:
                print(f"kvstore stats: {name} is not registered (down?)", file=sys.stderr)
        total = combine(target.group, mine) if target.group and mine else None
        docs += mine
        groups += [total] if total else []
        shown.append((total, mine))
    if args.json:
        print_json({"nodes": docs, "groups": groups, "errors": errors})
    else:
        _render_stats(shown)
    return 1 if errors else 0


def _render_stats(shown: list[tuple[dict[str, Any] | None, list[dict[str, Any]]]]) -> None:
    """Each node's table; a sharded node's totals, then a line per shard."""
    out = console()
    first = True
    for total, mine in shown:
        for doc in [total] if total is not None else mine:
            if not first:
                out.print()
            first = False
            render(out, doc)
        if total is not None:
            render_shards(out, mine)


def _stats_targets(args: argparse.Namespace, errors: list[dict[str, str]]) -> list[Target]:
    """The nodes ``stats`` shows: each ``--node`` (an address, or a name read from the
    directory), every node of the directory when only ``--etcd``/``--cluster`` is given,
    else the default address. An address that does not answer is an error of its own."""
    specs = args.node or ([] if args.etcd or args.cluster else [DEFAULT_NODE])
    names = [s for s in specs if not is_address(s)]
    nodes = read(args, lambda m: m.nodes())[1] if names or not specs else {}
    if not specs:
        return every_node(nodes)
    out = []
    for spec in specs:
        if not is_address(spec):
            out.append(from_directory(spec, nodes))
            continue
        try:
            with connect(spec, args) as c:
                out.append(from_info(spec, c.server_info))
        except KVStoreError as exc:
            errors.append({"node": spec, "code": exc.code, "error": str(exc)})
            if not args.json:
                error("stats", exc, spec)
    return out


def _node_stats(
    args: argparse.Namespace, address: str, errors: list[dict[str, str]]
) -> dict[str, Any] | None:
    """One process's summary, or None with its error noted (and shown, without --json)."""
    try:
        with connect(address, args) as c:
            info = c.server_info
            if args.tenant and args.tenant != info.get("tenant") and not info.get("admin"):
                raise PermissionDenied("a tenant token reads only its own tenant's stats")
            doc = summarize(address, c.stats(), args.tenant)
    except KVStoreError as exc:
        errors.append({"node": address, "code": exc.code, "error": str(exc)})
        if not args.json:
            error("stats", exc, address)
        return None
    group = str(info.get("group", ""))
    doc.update(group=group, shard=int(info.get("shard", 0)))
    doc["shards"] = int(info.get("shard_count", 0)) if group else 1
    return doc


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
            error("evict", exc, address)
    if args.json:
        print_json({"results": results})
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
