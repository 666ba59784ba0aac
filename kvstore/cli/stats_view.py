"""What ``kvstore stats`` shows: a node's stats folded into one summary, and its table.

The summary folds counters with the same code the Prometheus exporter uses
(:func:`kvstore.observe.names.fold_counters`), so a number in the table and the
matching series on a dashboard never disagree. Per-tenant views use the tenant-tagged
counters the server keeps (hits, misses, puts, bytes per path); capacity, blocks,
demotions, promotions and evictions are node-wide because the node never sees tenants.
The table fits an 80-column terminal; ``--json`` prints the summary itself.

A node served by ``kvstore serve --shards N`` is N processes, each with its own stats:
:func:`combine` sums its shards' summaries into the node's, which prints as any node's
does, and :func:`render_shards` follows it with one line per shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvstore.observe.counters import PATHS
from kvstore.observe.fmt import fmt_bytes
from kvstore.observe.names import (
    DEMOTIONS,
    EVICTIONS,
    HITS,
    MISSES,
    PROMOTIONS,
    PUT_BYTES,
    PUTS,
    TRANSFER,
    Family,
    fold_counters,
    merge_counters,
    tenant_family,
)

__all__ = ["combine", "count", "render", "render_shards", "summarize"]

_GAUGES = ("connections", "leases", "leases_expired", "credits_lent", "draining")  # not counters
_SUMMED = (
    *("blocks", "pinned", "lookups", "hits", "misses", "puts", "put_bytes"),
    *("connections", "leases", "credits_lent"),
)  # what a sharded node's summary sums over its shards


def summarize(address: str, stats: Mapping[str, Any], tenant: str | None = None) -> dict[str, Any]:
    """One node's StoreClient.stats() as the plain summary ``kvstore stats`` prints."""
    server = dict(stats.get("server", {}))
    counters = merge_counters(
        [stats["counters"], {k: v for k, v in server.items() if k not in _GAUGES}]
    )
    tiers = list(stats["tiers"])
    folded = fold_counters(counters, tiers)

    def get(f: Family, *labels: str, node_wide: bool = False) -> int:
        if tenant is None or node_wide:
            return int(folded.get((f, labels), 0))
        return int(folded.get((tenant_family(f), (*labels, tenant)), 0))

    per_tier = {}
    for name, t in stats["tiers"].items():
        per_tier[name] = {
            "capacity": int(t["capacity"]),
            "used": int(t["used"]),
            "blocks": int(t["blocks"]),
            "hits": get(HITS, name),
            "demotions": get(DEMOTIONS, name, node_wide=True),
            "promotions": get(PROMOTIONS, name, node_wide=True),
            "evictions": get(EVICTIONS, name, node_wide=True),
        }
    hits = sum(t["hits"] for t in per_tier.values())
    misses = get(MISSES)
    paths = [p for p in PATHS if not (tenant and p == "inproc")]
    return {
        "address": address,
        "node_id": str(stats["node_id"]),
        "tenant": tenant,
        "draining": bool(server.get("draining", 0)),
        "blocks": int(stats["blocks"]),
        "pinned": int(stats["pinned"]),
        "tiers": per_tier,
        "lookups": hits + misses,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "puts": get(PUTS),
        "put_bytes": get(PUT_BYTES),
        "bytes_in": {p: get(TRANSFER, "in", p) for p in paths},
        "bytes_out": {p: get(TRANSFER, "out", p) for p in paths},
        "connections": int(server.get("connections", 0)),
        "leases": int(server.get("leases", 0)),
        "credits_lent": int(server.get("credits_lent", 0)),
    }


def count(n: int) -> str:
    """A count in at most 7 characters: ``12,345``, ``123.4k``, ``12.3M``."""
    if n < 100_000:
        return f"{n:,}"
    if n < 10_000_000:
        return f"{n / 1e3:.1f}k" if n < 1_000_000 else f"{n / 1e6:.2f}M"
    return f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:.1f}G"


def render(console: Any, doc: Mapping[str, Any]) -> None:
    """Print one node's summary as a heading, a tier table and a transfer table."""
    from rich import box
    from rich.table import Table

    state = "[yellow]draining[/]" if doc["draining"] else "[green]serving[/]"
    who = f" · tenant [bold]{doc['tenant']}[/]" if doc["tenant"] else ""
    if doc.get("shard_nodes"):  # a sharded node's totals (combine)
        state += f" · {len(doc['shard_nodes'])} shards"
    console.print(
        f"[bold]{doc['node_id']}[/] {doc['address']} · {state} · {count(doc['blocks'])} "
        f"blocks, {count(doc['pinned'])} pinned{who}"
    )
    tiers = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, name in enumerate(
        ("tier", "capacity", "used", "blocks", "hits", "demoted", "promoted", "evicted")
    ):
        tiers.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    for name, t in doc["tiers"].items():
        pct = f"{100 * t['used'] / t['capacity']:.0f}%" if t["capacity"] else "-"
        tiers.add_row(
            name,
            fmt_bytes(t["capacity"]),
            f"{fmt_bytes(t['used'])} {pct}",
            count(t["blocks"]),
            count(t["hits"]),
            count(t["demotions"]),
            count(t["promotions"]),
            count(t["evictions"]),
        )
    console.print(tiers)
    rate = "-" if doc["hit_rate"] is None else f"{100 * doc['hit_rate']:.1f}%"
    console.print(
        f"lookups {count(doc['lookups'])} · hit rate {rate} · misses {count(doc['misses'])}"
        f" · puts {count(doc['puts'])} ({fmt_bytes(doc['put_bytes'])})"
    )
    moved = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("transport", "bytes in", "bytes out"):
        moved.add_column(name, justify="left" if name == "transport" else "right", no_wrap=True)
    for path in doc["bytes_in"]:
        moved.add_row(path, fmt_bytes(doc["bytes_in"][path]), fmt_bytes(doc["bytes_out"][path]))
    console.print(moved)
    if doc["tenant"]:
        console.print("[dim]the tenant's: hits, misses, puts, bytes; node-wide: the rest[/]")


def combine(group: str, shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A sharded node's summary: its shards' (from :func:`summarize`) summed, its hit
    rate recomputed, draining when any shard is (writers then avoid the whole node)."""
    first = shards[0]
    tiers: dict[str, dict[str, int]] = {}
    for doc in shards:
        for name, t in doc["tiers"].items():
            into = tiers.setdefault(name, dict.fromkeys(t, 0))
            for k, v in t.items():
                into[k] = into.get(k, 0) + v
    out: dict[str, Any] = {k: sum(d[k] for d in shards) for k in _SUMMED}
    out.update(
        address=first["address"],
        node_id=group,
        group=group,
        shards=max(int(d.get("shards", 1)) for d in shards),
        shard_nodes=[d["node_id"] for d in shards],
        tenant=first["tenant"],
        draining=any(d["draining"] for d in shards),
        tiers=tiers,
        hit_rate=out["hits"] / out["lookups"] if out["lookups"] else None,
        bytes_in=_sum_paths(d["bytes_in"] for d in shards),
        bytes_out=_sum_paths(d["bytes_out"] for d in shards),
    )
    return out


def _sum_paths(docs: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in docs:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def render_shards(console: Any, shards: Sequence[Mapping[str, Any]]) -> None:
    """One line per shard of a node, under the node's own table."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, name in enumerate(("shard", "address", "state", "blocks", "used", "hits", "puts")):
        t.add_column(name, justify="left" if i < 3 else "right", no_wrap=True)
    for d in shards:
        used = sum(t["used"] for t in d["tiers"].values())
        state = "[yellow]draining[/]" if d["draining"] else "serving"
        t.add_row(
            d["node_id"], d["address"], state, count(d["blocks"]), fmt_bytes(used),
            count(d["hits"]), count(d["puts"]),
        )  # fmt: skip
    console.print(t)
