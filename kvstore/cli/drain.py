"""``kvstore drain NODE``: stop a node's writes and move (or drop) its blocks.

NODE is an address or a name (kvstore/cli/targets.py): a sharded node, named by its
node name or its address (shard 0's), drains every shard; a shard's own name drains
that shard alone. Every process named refuses writes (and says so in its directory
record, so cluster clients write elsewhere) before the first block moves; then each
is drained in turn into the ``--to`` nodes (names allowed: a sharded target takes
blocks on whichever of its shards has room) by kvstore/client/drain.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstore.cli.calls import command, connect, guard, info_of, print_json
from kvstore.cli.directory import add_directory_flags
from kvstore.cli.targets import Target, resolve
from kvstore.client.store import NodeClient
from kvstore.errors import ConfigError
from kvstore.observe.fmt import fmt_bytes

__all__ = ["add_parser"]

_EXAMPLE = """\
examples:
  kvstore drain 127.0.0.1:7402 --to 127.0.0.1:7400   # move every block, then empty
  kvstore drain 127.0.0.1:7402 --drop                # just drop them (it is a cache)
  kvstore drain 127.0.0.1:7402 --undo                # take writes again
  kvstore drain n2 --to n1 --etcd 127.0.0.1:2379     # by name, from the directory
  kvstore drain n2.s1 --drop --etcd 127.0.0.1:2379   # one shard of a sharded node

A sharded node ('kvstore serve --shards N'), named by its name or its address, drains
every shard; a shard's name (NODE.sI, see 'kvstore nodes') drains that shard alone.
"""
_SUMMED = (
    *("blocks_at_start", "moved", "moved_bytes", "already_there", "dropped"),
    *("dropped_bytes", "remaining"),
)  # what a sharded node's drain sums over its shards


def add_parser(sub: Any) -> None:
    """Register ``drain``."""
    p = command(sub, "drain", "move or drop a node's blocks so it can leave (admin)", _EXAMPLE)
    p.add_argument("node", metavar="NODE", help="HOST:PORT or name of the node to drain")
    p.add_argument(
        "--to", action="append", default=[], metavar="NODE", help="node to move blocks to"
    )
    p.add_argument("--drop", action="store_true", help="drop blocks that have nowhere to go")
    p.add_argument("--undo", action="store_true", help="end a drain: take writes again")
    add_directory_flags(p)
    p.set_defaults(func=guard("drain", _cmd_drain))


def _cmd_drain(args: argparse.Namespace) -> int:
    if not args.undo and not args.to and not args.drop:
        raise ConfigError("give --to NODE to move the blocks, or --drop to drop them")
    source, *into = resolve([args.node, *args.to], args, info_of(args, "drain"))
    for name in source.missing:
        print(f"kvstore drain: {name} is not registered: not drained", file=sys.stderr)
    opened: list[NodeClient] = []  # closed at the end, whatever happens
    try:
        sources = _connect_all(source, args, opened)  # all reachable, or nothing changes
        if args.undo:
            return _undo(args, source, sources)
        for c in sources:  # every shard refuses writes before any block moves
            c.set_draining(True)
        targets = [c for t in into for c in _connect_all(t, args, opened)]
        procs = zip(source.processes, sources, strict=True)
        docs = [_drain_one(args, p.address, c, targets) for p, c in procs]
    finally:
        for c in opened:
            c.close()
    doc = docs[0] if not source.group else _group_doc(args.node, source, docs)
    if args.json:
        print_json(doc)
    else:
        for d in docs:
            _print_drain(d)
        print(f"  it takes no writes until restarted or: kvstore drain {args.node} --undo")
    return 0 if doc["remaining"] == 0 and not source.missing else 1


def _connect_all(
    target: Target, args: argparse.Namespace, opened: list[NodeClient]
) -> list[NodeClient]:
    """An admin client of each process of ``target``, each added to ``opened``."""
    out = []
    for p in target.processes:
        out.append(connect(p.address, args, admin="drain"))
        opened.append(out[-1])
    return out


def _undo(args: argparse.Namespace, source: Target, clients: list[NodeClient]) -> int:
    for p, c in zip(source.processes, clients, strict=True):
        c.set_draining(False)
        print(f"{p.address} ({p.node_id}): takes writes again", file=sys.stderr)
    if args.json:
        doc: dict[str, Any] = {"node": args.node, "draining": False}
        if source.group:
            doc.update(group=source.group, shards=[p.node_id for p in source.processes])
        print_json(doc)
    return 0 if not source.missing else 1


def _drain_one(
    args: argparse.Namespace, address: str, source: NodeClient, targets: list[NodeClient]
) -> dict[str, Any]:
    """Drain one process; its report as the command's document for one node."""
    from kvstore.client.drain import drain_node

    if args.json:
        report = drain_node(source, targets, drop=args.drop)
    else:
        report = _drain_with_progress(drain_node, address, source, targets, args.drop)
    return {"node": address, "draining": True, **_asdict(report)}


def _group_doc(spec: str, source: Target, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded node's drain: each shard's report and their sums."""
    per_target: dict[str, int] = {}
    for d in docs:
        for node, n in d["per_target"].items():
            per_target[node] = per_target.get(node, 0) + n
    doc: dict[str, Any] = {"node": spec, "node_id": source.group, "group": source.group}
    doc.update({k: sum(d[k] for d in docs) for k in _SUMMED})
    doc.update(draining=True, per_target=per_target, shards=docs, missing=list(source.missing))
    doc["errors"] = [f"{d['node_id']}: {e}" for d in docs for e in d["errors"]]
    return doc


def _drain_with_progress(
    drain: Any, address: str, source: NodeClient, targets: list[NodeClient], drop: bool
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
        task = bar.add_task(address, total=None, nbytes="")

        def update(done: int, nbytes: int, total: int) -> None:
            bar.update(task, completed=done, total=total, nbytes=fmt_bytes(nbytes))

        return drain(source, targets, drop=drop, progress=update)


def _asdict(report: Any) -> dict[str, Any]:
    return {name: getattr(report, name) for name in report.__slots__}


def _print_drain(doc: dict[str, Any]) -> None:
    """One process's drain in short lines (they fit 80 columns)."""
    print(f"drained {doc['node_id']} {doc['node']}: {doc['remaining']} blocks left")
    to = ", ".join(f"{n} to {node}" for node, n in doc["per_target"].items())
    print(
        f"  moved {doc['moved']} blocks ({fmt_bytes(doc['moved_bytes'])}){': ' + to if to else ''}"
        f"; {doc['already_there']} were there already"
    )
    print(f"  dropped {doc['dropped']} blocks ({fmt_bytes(doc['dropped_bytes'])})")
    for why in doc["errors"]:
        print(f"    because: {why}")
