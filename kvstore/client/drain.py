"""Draining a node: stop its writes, move (or drop) its blocks, leave it empty.

The order matters for clients: the node first refuses new writes (reads keep working,
kvstore/server/gateway.py), then each page of its blocks is exported, imported on a target
node under the same stored key and namespace fingerprint (so its owner's own key
still finds it there) and with the fingerprint's tenant and model when the source
knows them (so admin filters on the target select it), and only then purged from the
source. A reader of the source therefore gets the block or a clean miss, never an
error; a block still pinned by a reader leaves the index at once and its bytes at the
reader's last unpin.

A block that cannot move (too large for one message, refused by every target, or no
targets given with ``drop``) is dropped: this is a cache, and the owner re-prefills.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.client.admin import AdminClient, RawBlock, StoredBlock
from kvstore.client.store import NodeClient
from kvstore.errors import ConfigError, KVStoreError, StorageError

__all__ = ["DrainReport", "Progress", "drain_node"]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, int], None]  # (blocks done, bytes done, blocks total)
_MARGIN = 256 * 1024  # message bytes kept for headers and framing


@dataclass(slots=True)
class DrainReport:
    """What a drain did. ``remaining`` is the source's block count at the end (0 when
    the node is empty); ``errors`` holds the first few reasons blocks were dropped."""

    node_id: str
    blocks_at_start: int
    moved: int = 0
    moved_bytes: int = 0
    already_there: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    remaining: int = 0
    per_target: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class _Target:
    """A node that takes blocks, with a running estimate of its free bytes."""

    def __init__(self, client: NodeClient) -> None:
        self.client = client
        self.admin = AdminClient(client)
        st = client.stats()
        self.node_id = str(st["node_id"])
        self.free = sum(int(t["capacity"]) - int(t["used"]) for t in st["tiers"].values())
        self.alive = True


def drain_node(
    source: NodeClient,
    targets: Sequence[NodeClient] = (),
    *,
    drop: bool = False,
    page: int = 256,
    progress: Progress | None = None,
) -> DrainReport:
    """Drain the node behind ``source`` into ``targets`` (or drop its blocks with
    ``drop``); returns a report. Every client must hold an admin token."""
    if not targets and not drop:
        raise ConfigError("drain: name a node to move blocks to, or allow dropping them")
    src = AdminClient(source)
    source.set_draining(True)
    st = source.stats()
    report = DrainReport(str(st["node_id"]), int(st["blocks"]))
    pool = _targets(report.node_id, source, targets)
    budget = min([src.max_message_bytes] + [t.admin.max_message_bytes for t in pool]) - _MARGIN
    batch_max = int(source.server_info.get("limits", {}).get("max_batch", 1024))
    done = done_bytes = 0
    purged: set[bytes] = set()
    while True:
        blocks = src.scan(page)
        if not blocks:
            break
        for batch in _batches(blocks, budget, batch_max):
            _move(src, pool, batch, budget, report)
            for b in batch:
                if b.key in purged:  # purged once and listed again: the node is stuck
                    raise StorageError(f"drain: block {b.key.hex()} survives purge; stopping")
                purged.add(b.key)
            src.purge([b.key for b in batch])
            done += len(batch)
            done_bytes += sum(b.size for b in batch)
            if progress is not None:
                progress(done, done_bytes, max(report.blocks_at_start, done))
    report.remaining = int(source.stats()["blocks"])
    return report


def _targets(node_id: str, source: NodeClient, clients: Sequence[NodeClient]) -> list[_Target]:
    """Targets that may take blocks: not the source itself, not draining."""
    pool = []
    src_instance = source.server_info.get("instance_id")
    for c in clients:
        if c.server_info.get("instance_id") == src_instance:
            raise ConfigError(f"drain: {c.address} is the node being drained ({node_id})")
        if c.health() == "draining":
            raise ConfigError(f"drain: target {c.address} is draining itself")
        pool.append(_Target(c))
    return pool


def _batches(blocks: Sequence[StoredBlock], budget: int, batch_max: int) -> list[list[StoredBlock]]:
    """Consecutive groups that fit one message and one request's key limit."""
    out: list[list[StoredBlock]] = []
    cur: list[StoredBlock] = []
    size = 0
    for b in blocks:
        if cur and (size + b.size > budget or len(cur) >= batch_max):
            out.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += b.size
    if cur:
        out.append(cur)
    return out


def _move(
    src: AdminClient,
    pool: list[_Target],
    batch: list[StoredBlock],
    budget: int,
    report: DrainReport,
) -> None:
    """Copy one batch to the target with the most room; tally what could not move."""
    movable = [b for b in batch if b.size <= budget]
    for b in batch:
        if b.size > budget:
            _dropped(report, b.size, f"block of {b.size} bytes exceeds one message")
    live = [t for t in pool if t.alive]
    if not movable or not live:
        for b in movable:
            _dropped(report, b.size, "no target node" if not pool else "every target failed")
        return
    exported = [r for r in src.export([b.key for b in movable]) if r is not None]
    while live:
        target = max(live, key=lambda t: t.free)
        try:
            results = target.admin.import_blocks(exported)
        except KVStoreError as exc:
            log.warning("drain: target %s failed (%s); trying another", target.node_id, exc)
            target.alive = False
            report.errors.append(f"{target.node_id}: {exc}")
            live = [t for t in pool if t.alive]
            continue
        _tally(report, target, exported, results)
        return
    for r in exported:
        _dropped(report, r.header.total_len, "every target failed")


def _tally(
    report: DrainReport,
    target: _Target,
    blocks: Sequence[RawBlock],
    results: Sequence[bool | KVStoreError],
) -> None:
    for blk, res in zip(blocks, results, strict=True):
        size = blk.header.total_len
        if isinstance(res, KVStoreError):
            _dropped(report, size, f"{target.node_id} refused a block: {res}")
            continue
        if res:
            report.moved += 1
            report.moved_bytes += size
            target.free -= size
            report.per_target[target.node_id] = report.per_target.get(target.node_id, 0) + 1
        else:
            report.already_there += 1


def _dropped(report: DrainReport, size: int, why: str) -> None:
    report.dropped += 1
    report.dropped_bytes += size
    if len(report.errors) < 5 and why not in report.errors:
        report.errors.append(why)
