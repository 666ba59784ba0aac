"""What ``kvstore nodes`` shows: each registered node as a document, and the table.

A node served by ``kvstore serve --shards N`` registers each shard as a node of its
own (``<group>.s<i>``, kvstore/wire/shards.py). The JSON keeps one entry per
registration, each saying its ``group``, ``shard`` and ``shards`` ("", 0, 1 for a
whole node), so a script sees exactly what clients route by. The table shows a
sharded node as one row with its totals, its shards indented beneath it, and a shard
whose record is missing (down, or not back yet) as ``missing``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.directory.records import NodeInfo
from kvstore.observe.fmt import fmt_bytes
from kvstore.wire.shards import shard_name

__all__ = ["COLUMNS", "node_doc", "table_rows"]

COLUMNS = (
    ("node", "left"),
    ("address", "left"),
    ("host", "left"),
    ("tiers", "left"),
    ("state", "left"),
    ("blocks", "right"),
    ("bytes", "right"),
)


def node_doc(info: NodeInfo, blocks: int, nbytes: int) -> dict[str, Any]:
    """One registration as ``kvstore nodes --json`` prints it."""
    return {
        "node_id": info.node_id,
        "host": info.host,
        "address": info.address,
        "data_address": info.data_address,
        "shm_name": info.shm_name,
        "boot_id": info.boot_id,
        "host_id": info.host_id,
        "epoch": f"{info.epoch:x}",
        "tiers": {t.value: cap for t, cap in info.tiers.items()},
        "draining": info.draining,
        "group": info.group,
        "shard": info.shard,
        "shards": info.shards,
        "blocks": blocks,
        "bytes": nbytes,
    }


def table_rows(docs: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The table's rows (see :data:`COLUMNS`), whole nodes and groups by name, each
    group's shards beneath it in shard order."""
    whole: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        if d["group"]:
            groups.setdefault(d["group"], []).append(d)
        else:
            whole[d["node_id"]] = d
    rows: list[tuple[str, ...]] = []
    for name in sorted(set(whole) | set(groups)):
        if name in whole:
            rows.append(_row(whole[name], whole[name]["node_id"], _state(whole[name])))
        if name in groups:
            rows += _group_rows(name, groups[name])
    return rows


def _group_rows(group: str, shards: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    by_index = {d["shard"]: d for d in shards}
    count = max(d["shards"] for d in shards)
    total = {
        "address": by_index[0]["address"] if 0 in by_index else "",
        "host": shards[0]["host"],
        "tiers": _sum_tiers(d["tiers"] for d in shards),
        "blocks": sum(d["blocks"] for d in shards),
        "bytes": sum(d["bytes"] for d in shards),
    }
    draining = sum(1 for d in shards if d["draining"])
    if draining == len(shards):
        state = "[yellow]draining[/]"
    elif draining:
        state = f"[yellow]draining {draining}/{count}[/]"  # writes avoid the whole node
    else:
        state = "serving"
    if len(shards) < count:
        state += f", [red]{len(shards)}/{count} listed[/]"
    rows = [_row(total, f"{group} ({count} shards)", state)]
    for i in range(count):
        d = by_index.get(i)
        name = f"  {shard_name(group, i)}"
        if d is None:
            rows.append((name, "", "", "", "[red]missing[/]", "", ""))  # down, or not back yet
        else:
            rows.append(_row(d, name, _state(d)))
    return rows


def _row(d: dict[str, Any], name: str, state: str) -> tuple[str, ...]:
    tiers = " ".join(f"{k}:{_size(v)}" for k, v in d["tiers"].items())
    return (name, d["address"], d["host"], tiers, state, str(d["blocks"]), fmt_bytes(d["bytes"]))


def _size(n: int) -> str:
    """``32.0 MiB`` as ``32MiB``: the tiers column stays narrow."""
    return fmt_bytes(n).replace(".0 ", " ").replace(" ", "")


def _state(d: dict[str, Any]) -> str:
    return "[yellow]draining[/]" if d["draining"] else "serving"


def _sum_tiers(tiers: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        for k, v in t.items():
            out[k] = out.get(k, 0) + v
    return out
