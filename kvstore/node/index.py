"""BlockIndex: where every block of one node lives and who is reading it.

The index maps each stored key to its Entry (tier level, place in the tier, size,
header, pins, recency) and keeps each tier's eviction order (policy.py) and, when a
server publishes it, the shared-memory index of DRAM blocks (kvstore/shm/index.py).
It moves no bytes: the mover (mover.py) copies them between tiers and StoreNode
(store.py) in and out of them, asking the index at each step.

One lock, three faces. The index owns the node's one lock and the state it guards
(state.py, where the concurrency contract is written). This class is the face
StoreNode uses: queries, pins, commits, removals, publishing and budgets. Room in a
tier is claimed through :attr:`BlockIndex.claims` (claims.py, the allocator) and the
mover records its moves through :attr:`BlockIndex.moves` (moves.py). Every public
method of each face takes the lock at most once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from kvstore.blocks import BlockHeader
from kvstore.events import BlockStored, EventQueue
from kvstore.keys import BlockKey
from kvstore.node.budgets import Budget, Usage
from kvstore.node.claims import Claims
from kvstore.node.eviction import BlockFilter
from kvstore.node.moves import MoveSteps
from kvstore.node.state import Entry, IndexState
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import NO_PLACE, Tier

__all__ = ["BlockIndex"]


class BlockIndex:
    """Key -> Entry for one node's tiers, their eviction order, pins and events."""

    def __init__(
        self, tiers: Sequence[Tier], policy: str, events: EventQueue, counters: NodeCounters
    ) -> None:
        self._policy = policy
        self.state = IndexState(tiers, events, counters)
        self.claims = Claims(self.state)
        self.moves = MoveSteps(self.state)

    # -- opening and closing ---------------------------------------------------------------

    def add_tier(self, tier: Tier) -> None:
        """Index a tier appended below the others (with its own policy), and the blocks
        it already holds (a persistent tier after a restart)."""
        s = self.state
        with s.lock:
            level = s.add_level_locked(self._policy, tier.capacity)
        now = time.monotonic()
        for key, header in tier.stored():  # tier I/O: outside the lock
            size = header.total_len
            with s.lock:
                s.entries[key] = Entry(key, level, NO_PLACE, size, header, used_at=now)
                s.policies[level].insert(key, size)
                s.ledger.add(header.namespace_fp, level, key, size)
                s.events.put(BlockStored(key, tier.kind, size, header.namespace_fp))

    def publish(self, writer: IndexWriter | None) -> str:
        """Keep ``writer`` (the shared-memory index of the tier same-host readers map)
        in step from now on, starting with what that tier holds; returns the name of
        the index kept (an earlier one stays; None just asks for its name)."""
        s = self.state
        with s.lock:
            if s.published is None and writer is not None:
                s.published = writer
                for e in s.entries.values():
                    s.publish_locked(e)
            elif writer is not None and writer is not s.published:
                writer.close()
            return "" if s.published is None else s.published.name

    @property
    def published(self) -> bool:
        """Whether a shared-memory index is kept in step."""
        return self.state.published is not None

    def close(self) -> IndexWriter | None:
        """Stop publishing; returns the writer for the caller to close."""
        s = self.state
        with s.lock:
            writer, s.published = s.published, None
        return writer

    # -- queries ----------------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (any tier)."""
        s = self.state
        with s.lock:
            return [k in s.entries for k in keys]

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored."""
        s = self.state
        n = 0
        with s.lock:
            for k in keys:
                if k not in s.entries:
                    break
                n += 1
        return n

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        s = self.state
        with s.lock:
            e = s.entries.get(key)
            return None if e is None else s.tiers[e.level].kind

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        s = self.state
        with s.lock:
            return [
                BlockKey(e.key)
                for e in s.entries.values()
                if tier is None or s.tiers[e.level].kind is tier
            ]

    def snapshot(self) -> list[tuple[BlockKey, TierKind, int]]:
        """Every block with its tier and size, at one instant (for re-syncs)."""
        s = self.state
        with s.lock:
            return [(BlockKey(e.key), s.tiers[e.level].kind, e.size) for e in s.entries.values()]

    def scan(
        self, limit: int, tier: TierKind | None = None, flt: BlockFilter | None = None
    ) -> list[tuple[BlockKey, TierKind, int, bytes]]:
        """Up to ``limit`` blocks as (key, tier, size, namespace fingerprint), oldest
        stored first, those ``flt`` accepts."""
        s = self.state
        now = time.monotonic()
        with s.lock:
            rows = (
                (BlockKey(e.key), s.tiers[e.level].kind, e.size, e.header.namespace_fp)
                for e in s.entries.values()
                if (tier is None or s.tiers[e.level].kind is tier)
                and (flt is None or flt.matches(e.key, e.header.namespace_fp, e.used_at, now))
            )
            return list(itertools.islice(rows, limit))

    def stats(self) -> tuple[dict[str, dict[str, int]], int]:
        """Per tier: capacity, used, blocks; plus the number of pinned blocks."""
        s = self.state
        with s.lock:
            per = {
                t.kind.value: {"capacity": t.capacity, "used": t.used, "blocks": 0} for t in s.tiers
            }
            for e in s.entries.values():
                per[s.tiers[e.level].kind.value]["blocks"] += 1
            pinned = sum(1 for e in s.entries.values() if e.pins)
        return per, pinned

    # -- reads ------------------------------------------------------------------------------

    def pin(self, key: bytes, namespace_fp: bytes | None) -> tuple[Entry, int, int] | None:
        """Pin a block (a hit) and return it with its (level, place) now, or count a
        miss; a namespace mismatch is a miss."""
        s = self.state
        with s.lock:
            e = s.entries.get(key)
            if e is None:
                s.counters.inc("misses")
                return None
            if namespace_fp is not None and e.header.namespace_fp != namespace_fp:
                s.counters.inc("namespace_mismatch")
                s.counters.inc("misses")
                return None
            e.pins += 1
            e.used_at = time.monotonic()
            s.policies[e.level].touch(key)
            s.ledger.touch(e.header.namespace_fp, e.level, key)
            s.counters.inc(f"hits_{s.tiers[e.level].kind.value}")
            return e, e.level, e.place

    def unpin(self, e: Entry) -> None:
        """Unpin; places left behind by moves or removals are released at the last unpin."""
        s = self.state
        with s.lock:
            e.pins -= 1
            if e.pins == 0:
                s.release_stale_locked(e)

    def touch(self, keys: Sequence[bytes]) -> int:
        """Count reads that happened without a pin (published-index readers) as DRAM hits
        and refresh each block's recency; returns how many are still stored."""
        s = self.state
        now = time.monotonic()
        found = 0
        with s.lock:
            s.counters.inc("hits_dram", len(keys))
            for key in keys:
                e = s.entries.get(key)
                if e is not None:
                    e.used_at = now
                    s.policies[e.level].touch(key)
                    s.ledger.touch(e.header.namespace_fp, e.level, key)
                    found += 1
        return found

    # -- writes ---------------------------------------------------------------------

    def commit(self, key: bytes, level: int, place: int, header: BlockHeader) -> bool:
        """Make a filled, sealed block visible (its reservation, claimed with
        ``reservation``, ends). False (its place released) when the key was stored
        meanwhile: keys name content, the first copy stays."""
        s = self.state
        size = header.total_len
        with s.lock:
            s.ledger.unreserve(header.namespace_fp, size)
            s.end_write_locked(level)
            if key in s.entries:
                s.tiers[level].release(key, place)
                return False
            e = Entry(key, level, place, size, header, used_at=time.monotonic())
            s.entries[key] = e
            s.publish_locked(e)
            s.policies[level].insert(key, size)
            s.ledger.add(header.namespace_fp, level, key, size)
            s.events.put(BlockStored(key, s.tiers[level].kind, size, header.namespace_fp))
        return True

    def discard(
        self, key: bytes, level: int, place: int, reserved: tuple[bytes, int] | None = None
    ) -> None:
        """Release a place that never became (or no longer is) a visible block's;
        ``reserved`` = (namespace fp, size) ends the reservation it was claimed for."""
        s = self.state
        with s.lock:
            if reserved is not None:
                s.ledger.unreserve(*reserved)
                s.end_write_locked(level)
            s.discard_locked(key, level, place)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget blocks; returns how many were present. Pinned ones' places are
        released at their last unpin."""
        s = self.state
        n = 0
        with s.lock:
            for k in keys:
                e = s.entries.get(k)
                if e is not None:
                    s.drop_locked(e)
                    n += 1
        return n

    # -- budgets ------------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Install or replace (by name) the budget of a set of namespaces."""
        s = self.state
        with s.lock:
            s.ledger.set_budget(budget)

    def usage(self, budget: Budget) -> Usage:
        """What a budget's namespaces hold now, per tier, and their writes in flight."""
        s = self.state
        with s.lock:
            return s.ledger.usage(budget, len(s.tiers))
