"""TierChain: one node's block index over its tiers, and the moves between them.

The chain knows where every block lives (tier level and extent), which blocks are
pinned, and how to make room: a full tier's policy picks a victim, which is demoted
one tier down (HBM -> DRAM -> SSD) or, from the last tier, dropped; an SSD hit is
promoted back to the top tier. A block lives in exactly one tier at a time.
StoreNode (node.py) builds the public API on top: validation, two-phase writes,
reads into caller buffers.

Concurrency contract (one lock, ``self.lock``, guards everything below it):
- ``index`` (key -> _Entry), each entry's fields, the memory tiers' allocators, the
  policies, the node's reservations and the event queue order;
- byte copies (put fills, get copies, demotion and promotion I/O) run OUTSIDE the
  lock, on extents kept alive by a pin (``entry.pins``) or a reservation;
- an entry with ``pins > 0`` or ``state != READY`` is never chosen as a victim;
- a storage location that a pinned reader may still use is not freed when the
  entry moves or is removed: it goes to ``entry.stale`` and is freed at last unpin.
Readers therefore never see freed or reused bytes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader
from kvstore.errors import BlockTooLarge, CapacityError, CorruptBlock, KVStoreError, NotFound
from kvstore.events import BlockMoved, BlockRemoved, BlockStored, EventQueue
from kvstore.keys import BlockKey
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tiering import TierKind
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.policy import EvictionPolicy, make_policy

__all__ = ["TierChain"]

log = logging.getLogger(__name__)


class _State(IntEnum):
    READY = 0
    MOVING = 1  # being demoted or promoted; readable from its current place


@dataclass(slots=True)
class _Entry:
    key: bytes
    level: int  # index into StoreNode._tiers
    offset: int  # extent offset in a memory tier; -1 on disk
    size: int  # header + payload bytes
    header: BlockHeader
    pins: int = 0
    state: _State = _State.READY
    gone: bool = False  # removed from the index while pinned
    stale: list[tuple[int, int]] = field(default_factory=list)  # (level, offset) to free
    used_at: float = 0.0  # time.monotonic() of the last store or hit (admin --older-than)


class TierChain:
    """The index, the tiers (fastest first), their policies, and block movement."""

    def __init__(self, policy: str, events: EventQueue, counters: NodeCounters) -> None:
        self.policy = policy
        self.events = events
        self.counters = counters
        self.lock = threading.Lock()
        self.index: dict[bytes, _Entry] = {}
        self.tiers: list[Tier] = []
        self.policies: list[EvictionPolicy] = []
        self.published: IndexWriter | None = None  # same-host readers' DRAM index

    def publish_dram(self, writer: IndexWriter) -> None:
        """Keep ``writer`` (the shared-memory index of the DRAM tier) in step with the
        index from now on, starting with every block DRAM holds now."""
        with self.lock:
            self.published = writer
            for e in self.index.values():
                self._publish_locked(e)

    def _publish_locked(self, e: _Entry) -> None:
        w = self.published
        if (
            w is not None
            and self.tiers[e.level].kind is TierKind.DRAM
            and not w.publish(e.key, e.offset)
        ):
            self.counters.inc("shm_index_full")  # its reads take a lease instead

    def _unpublish_locked(self, e: _Entry) -> None:
        """Before a DRAM extent is left (freed now or at the last unpin): readers
        that copy without a pin check the index after copying (tiers/shm_index.py)."""
        if self.published is not None and self.tiers[e.level].kind is TierKind.DRAM:
            self.published.unpublish(e.key)

    def add_tier(self, tier: Tier) -> None:
        """Append a tier below the existing ones, with its own policy instance."""
        self.tiers.append(tier)
        self.policies.append(make_policy(self.policy, tier.capacity))

    def reload_disk(self) -> None:
        """Re-list the SSD tier after a restart and announce what it still holds."""
        level = len(self.tiers) - 1
        disk = self.tiers[level]
        assert isinstance(disk, DiskTier)
        now = time.monotonic()
        for key, header in disk.scan():
            size = header.total_len
            self.index[key] = _Entry(key, level, -1, size, header, used_at=now)
            self.policies[level].insert(key, size)
            self.events.put(BlockStored(key, TierKind.SSD, size, header.namespace_fp))

    # -- pins ------------------------------------------------------------------------------

    def acquire(self, key: bytes, namespace_fp: bytes | None) -> tuple[_Entry, int, int] | None:
        """Pin a block (a hit) or count a miss; a namespace mismatch is a miss."""
        with self.lock:
            e = self.index.get(key)
            if e is None:
                self.counters.inc("misses")
                return None
            if namespace_fp is not None and e.header.namespace_fp != namespace_fp:
                self.counters.inc("namespace_mismatch")
                self.counters.inc("misses")
                return None
            e.pins += 1
            e.used_at = time.monotonic()
            self.policies[e.level].touch(key)
            self.counters.inc(f"hits_{self.tiers[e.level].kind.value}")
            return e, e.level, e.offset

    def touch(self, keys: list[bytes]) -> int:
        """Count reads that happened without a pin (published-index readers copy from
        DRAM) as DRAM hits and refresh each block's place in the eviction order;
        returns how many of the blocks are still stored."""
        now = time.monotonic()
        found = 0
        with self.lock:
            self.counters.inc("hits_dram", len(keys))
            for key in keys:
                e = self.index.get(key)
                if e is not None:
                    e.used_at = now
                    self.policies[e.level].touch(key)
                    found += 1
        return found

    def release(self, e: _Entry) -> None:
        """Unpin; storage left behind by moves or removals is freed at the last unpin."""
        with self.lock:
            e.pins -= 1
            if e.pins == 0:
                self._free_stale_locked(e)

    def _free_stale_locked(self, e: _Entry) -> None:
        while e.stale:
            level, offset = e.stale.pop()
            tier = self.tiers[level]
            if isinstance(tier, MemoryTier):
                tier.free(offset)
            else:
                cur = self.index.get(e.key)
                if cur is None or self.tiers[cur.level] is not tier:
                    tier.delete(e.key)  # type: ignore[attr-defined]

    def drop_locked(self, e: _Entry) -> None:
        """Forget an entry now; free its storage now or at its last unpin."""
        if self.index.get(e.key) is e:
            del self.index[e.key]
        e.gone = True
        self._unpublish_locked(e)
        self.policies[e.level].remove(e.key)
        self.events.put(BlockRemoved(e.key, self.tiers[e.level].kind))
        e.stale.append((e.level, e.offset))
        if e.pins == 0:
            self._free_stale_locked(e)

    # -- eviction, demotion, promotion -----------------------------------------------------------

    def _busy(self, key: Any) -> bool:
        e = self.index.get(key)
        return e is None or e.pins > 0 or e.state is not _State.READY

    def make_room(self, level: int, size: int) -> int:
        """Make ``size`` bytes free in tier ``level``; returns an extent offset for
        memory tiers (-1 for disk). Demotes victims one tier down, outside the lock."""
        tier = self.tiers[level]
        if not tier.fits_ever(size):
            raise BlockTooLarge(f"block of {size} bytes exceeds the {tier.kind.value} tier")
        for _ in range(1 << 16):
            with self.lock:
                if isinstance(tier, MemoryTier):
                    off = tier.alloc(size)
                    if off is not None:
                        return off
                elif tier.has_room(size):  # type: ignore[attr-defined]
                    return -1
                victim_key = self.policies[level].pop_victim(self._busy)
                if victim_key is None:
                    raise CapacityError(
                        f"{tier.kind.value} tier is full and every block in it is pinned"
                    )
                victim = self.index[victim_key]  # type: ignore[index]
                if level + 1 == len(self.tiers):  # last tier: the victim leaves the node
                    self.counters.inc(f"evictions_{tier.kind.value}")
                    self.drop_locked(victim)
                    continue
                victim.state = _State.MOVING
                victim.pins += 1
            self._demote(victim)
        raise CapacityError(f"could not free {size} bytes in the {tier.kind.value} tier")

    def _demote(self, e: _Entry) -> None:
        """Move a victim (state MOVING, pinned by us) one tier down, or drop it."""
        src_level = e.level
        dst_level = src_level + 1
        src = self.tiers[src_level]
        assert isinstance(src, MemoryTier)
        new_offset: int | None = None
        if dst_level < len(self.tiers):
            try:
                new_offset = self._copy_down(e, src, dst_level)
            except KVStoreError as exc:
                log.warning("demotion of %s failed, dropping it: %s", e.key.hex(), exc)
                new_offset = None
        with self.lock:
            e.state = _State.READY
            e.pins -= 1
            if new_offset is None or e.gone:
                if not e.gone:
                    self.counters.inc(f"evictions_{src.kind.value}")
                    self.drop_locked(e)
                elif new_offset is not None:
                    self._discard_locked(e.key, dst_level, new_offset)
                return
            self._unpublish_locked(e)
            e.stale.append((src_level, e.offset))
            e.level, e.offset = dst_level, new_offset
            self._publish_locked(e)
            self.policies[dst_level].insert(e.key, e.size)
            self.events.put(BlockMoved(e.key, src.kind, self.tiers[dst_level].kind))
            self.counters.inc(f"demotions_{src.kind.value}")
            self.counters.inc(f"bytes_demoted_{src.kind.value}", e.size)
            if e.pins == 0:
                self._free_stale_locked(e)

    def _copy_down(self, e: _Entry, src: MemoryTier, dst_level: int) -> int:
        dst = self.tiers[dst_level]
        for _attempt in range(3):
            off = self.make_room(dst_level, e.size)
            try:
                if isinstance(dst, MemoryTier):
                    dst.write_header(off, e.header.pack())
                    dst.write_payload(off, src.payload(e.offset, e.header.payload_len))
                else:
                    payload = src.host_view(e.offset + HEADER_SIZE, e.header.payload_len)
                    dst.write(e.key, e.header.pack(), payload)  # type: ignore[attr-defined]
                return off
            except CapacityError:
                continue  # another writer took the room between check and write
        raise CapacityError(f"no room in the {dst.kind.value} tier after 3 tries")

    def _discard_locked(self, key: bytes, level: int, offset: int) -> None:
        tier = self.tiers[level]
        if isinstance(tier, MemoryTier):
            tier.free(offset)
        elif key not in self.index:
            tier.delete(key)  # type: ignore[attr-defined]

    def read_disk(self, e: _Entry, level: int) -> tuple[Any, int] | None:
        """Read a pinned SSD block, verified; promote it to the top tier when possible.

        Returns (payload, offset): a view into the top tier and its extent after a
        promotion, else a private buffer and -1. None when the record is corrupt or
        gone (counted; the entry is dropped).
        """
        disk = self.tiers[level]
        assert isinstance(disk, DiskTier)
        n = e.header.payload_len
        with self.lock:
            promote = e.state is _State.READY and not e.gone and e.level == level
            if promote:
                e.state = _State.MOVING
        off: int | None = None
        top = self.tiers[0]
        assert isinstance(top, MemoryTier)
        if promote:
            try:
                off = self.make_room(0, e.size)
            except KVStoreError:
                off = None
        buf = top.payload(off, n) if off is not None else np.empty(n, dtype=np.uint8)
        try:
            disk.read_into(e.key, buf)
        except (CorruptBlock, NotFound) as exc:
            self.counters.inc("corrupt_blocks" if isinstance(exc, CorruptBlock) else "lost_blocks")
            log.warning("SSD block %s unreadable: %s", e.key.hex(), exc)
            with self.lock:
                if off is not None:
                    top.free(off)
                e.state = _State.READY
                if not e.gone:
                    self.drop_locked(e)
            return None
        if off is None:
            if promote:
                with self.lock:
                    e.state = _State.READY
            return buf, -1
        top.write_header(off, e.header.pack())
        with self.lock:
            e.state = _State.READY
            if e.gone:
                top.free(off)
                return np.array(buf), -1  # removed meanwhile: hand out a private copy
            self.policies[level].remove(e.key)
            e.stale.append((level, -1))
            e.level, e.offset = 0, off
            self._publish_locked(e)
            self.policies[0].insert(e.key, e.size)
            self.events.put(BlockMoved(e.key, TierKind.SSD, top.kind))
            self.counters.inc("promotions")
            self.counters.inc("bytes_promoted", e.size)
        return buf, off

    def evict(self, tier: TierKind, target_bytes: int) -> int:
        """Demote (or drop, from the last tier) blocks until ``tier`` uses at most
        ``target_bytes``; pinned blocks are skipped. Returns how many blocks went."""
        return self.evict_where(tier, target_bytes).moved

    def evict_where(
        self,
        tier: TierKind,
        target_bytes: int,
        flt: BlockFilter | None = None,
        *,
        dry_run: bool = False,
        list_limit: int = 0,
    ) -> EvictResult:
        """Evict blocks ``flt`` accepts, in the tier's eviction order, until the tier
        uses at most ``target_bytes`` or no candidate is left.

        Memory tiers demote to the next tier, the last tier drops. Pinned (or moving)
        candidates are never taken; they are counted in ``skipped_pinned``. A dry run
        plans under the lock and changes nothing. The plan is made under the lock and
        carried out one block at a time (each re-checked, demotion I/O outside the
        lock), in rounds, because writers may fill the tier meanwhile.
        """
        flt = flt or BlockFilter()
        level = [t.kind for t in self.tiers].index(tier)
        demotes = isinstance(self.tiers[level], MemoryTier) and level + 1 < len(self.tiers)
        res = EvictResult(tier.value, self.tiers[level].capacity, self.tiers[level].used)
        res.dry_run = dry_run
        res.next_tier = self.tiers[level + 1].kind.value if demotes else ""
        skipped: set[bytes] = set()
        for _round in range(64):
            with self.lock:
                plan, projected = self._plan_locked(level, target_bytes, flt, skipped)
            res.blocks.extend(plan[: max(list_limit - len(res.blocks), 0)])
            if dry_run:
                res.used_after = projected
                res.nbytes = sum(size for _, size in plan)
                res.demoted, res.dropped = (len(plan), 0) if demotes else (0, len(plan))
                break
            if not any([self._evict_one(level, k, target_bytes, res, skipped) for k, _ in plan]):
                break
        res.skipped_pinned = len(skipped)
        if not dry_run:
            res.used_after = self.tiers[level].used
        return res

    def _plan_locked(
        self, level: int, target: int, flt: BlockFilter, skipped: set[bytes]
    ) -> tuple[list[tuple[bytes, int]], int]:
        """Candidates (key, size) in eviction order until the projected use reaches
        ``target``, and that projected use."""
        projected = self.tiers[level].used
        plan: list[tuple[bytes, int]] = []
        now = time.monotonic()
        for key in self.policies[level]:
            if projected <= target:
                break
            e = self.index.get(key)  # type: ignore[call-overload]
            if e is None or e.level != level:
                continue
            if not flt.matches(e.key, e.header.namespace_fp, e.used_at, now):
                continue
            if e.pins > 0 or e.state is not _State.READY:
                skipped.add(e.key)
                continue
            plan.append((e.key, e.size))
            projected -= e.size
        return plan, max(projected, 0)

    def _evict_one(
        self, level: int, key: bytes, target: int, res: EvictResult, skipped: set[bytes]
    ) -> bool:
        """Demote or drop one planned block; False when the target is met or it is gone."""
        tier = self.tiers[level]
        with self.lock:
            if tier.used <= target:
                return False
            e = self.index.get(key)
            if e is None or e.level != level:
                return False  # removed or moved since the plan
            if e.pins > 0 or e.state is not _State.READY:
                skipped.add(key)
                return False
            self.policies[level].remove(key)
            res.nbytes += e.size
            if not res.next_tier:
                self.counters.inc(f"evictions_{tier.kind.value}")
                self.drop_locked(e)
                res.dropped += 1
                return True
            e.state, e.pins = _State.MOVING, e.pins + 1
        self._demote(e)
        res.demoted += 1
        return True

    def scan(
        self, limit: int, tier: TierKind | None = None, flt: BlockFilter | None = None
    ) -> list[tuple[BlockKey, TierKind, int, bytes]]:
        """Up to ``limit`` blocks as (key, tier, size, namespace fingerprint), oldest
        stored first (dict order): cheap per call, so a drain that removes what it moved
        can page through a node. ``flt`` (namespaces, key prefix, idle time) narrows it,
        for ``kvstore ls``."""
        now = time.monotonic()
        with self.lock:
            rows = (
                (BlockKey(k), self.tiers[e.level].kind, e.size, e.header.namespace_fp)
                for k, e in self.index.items()
                if (tier is None or self.tiers[e.level].kind is tier)
                and (flt is None or flt.matches(k, e.header.namespace_fp, e.used_at, now))
            )
            return list(itertools.islice(rows, limit))

    # -- queries ---------------------------------------------------------------------------

    def insert_locked(self, key: bytes, level: int, offset: int, size: int, h: BlockHeader) -> None:
        """Make a committed block visible (caller holds the lock, key not present)."""
        e = self.index[key] = _Entry(key, level, offset, size, h, used_at=time.monotonic())
        self._publish_locked(e)
        self.policies[level].insert(key, size)
        self.events.put(BlockStored(key, self.tiers[level].kind, size, h.namespace_fp))

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        with self.lock:
            e = self.index.get(key)
            return None if e is None else self.tiers[e.level].kind

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        with self.lock:
            return [
                BlockKey(k)
                for k, e in self.index.items()
                if tier is None or self.tiers[e.level].kind is tier
            ]

    def snapshot(self) -> list[tuple[BlockKey, TierKind, int]]:
        """Every block with its tier and size, taken under one lock (for re-syncs)."""
        with self.lock:
            return [(BlockKey(k), self.tiers[e.level].kind, e.size) for k, e in self.index.items()]

    def tier_stats(self) -> tuple[dict[str, dict[str, int]], int]:
        """Per tier: capacity, used, blocks; plus the number of pinned blocks."""
        with self.lock:
            per = {
                t.kind.value: {"capacity": t.capacity, "used": t.used, "blocks": 0}
                for t in self.tiers
            }
            for e in self.index.values():
                per[self.tiers[e.level].kind.value]["blocks"] += 1
            pinned = sum(1 for e in self.index.values() if e.pins)
        return per, pinned

    def close(self) -> None:
        """Close every tier (and the published index first); idempotent."""
        with self.lock:
            writer, self.published = self.published, None
        if writer is not None:
            writer.close()
        for t in self.tiers:
            t.close()
