"""BlockIndex: where every block of one node lives, who is reading it, and the lock.

The index maps each stored key to its Entry (tier level, place in the tier, size,
header, pins, recency) and keeps each tier's eviction order (policy.py) and, when a
server publishes it, the shared-memory index of DRAM blocks (kvstore/shm/index.py).
It moves no bytes: the mover (mover.py) copies them between tiers and StoreNode
(store.py) in and out of them, asking the index at each step.

Concurrency contract. ``_lock`` (one plain Lock) guards:
- ``_entries`` and every field of every Entry;
- the per-tier policies, the published DRAM index and the order of events;
- the tiers' space: ``Tier.allocate`` and ``Tier.release`` are called only under it.
Every public method takes the lock at most once and returns with it released; callers
never hold it. Byte copies (a reservation's fill, a read's copy, demotion and
promotion I/O) run OUTSIDE it, on places kept alive by a pin (``Entry.pins``), a
reservation, or the MOVING state. An entry with ``pins > 0`` or ``state != READY`` is
never a victim. A place a pinned reader may still use is not released when its entry
moves or goes: it joins ``Entry.stale`` and is released at the last unpin, so readers
never see freed or reused bytes. Lock order: this lock, then a tier's own (the SSD
tier's index lock); a tier never calls back into the index.

Waiting for room. A writer that finds a tier full and every block in it pinned or
MOVING does not fail while demotions out of that tier, or writes into it, are in
flight (``_demoting``, ``_writing``: a committed write is a block that can be demoted):
it waits on ``_room`` (a Condition over ``_lock``, notified as each demotion or write
ends) for up to ``ROOM_WAIT_S``, then looks again. Only a tier with nothing on its way
in or out is reported full (CapacityError, retryable).

Budgets. A set of namespaces may have a Budget (budgets.py: a tenant's quota as the
server hands it down); the index's Ledger keeps each namespace's bytes and blocks per
tier and its writes in flight, under the same lock, and ``claim`` applies the budget
of the namespace it claims for: past its writes in flight, QuotaExceeded; past its
bytes in the tier, its own least recently used block there is the victim, never
another namespace's.

Kept copies. Promoting an SSD block to the top tier keeps its SSD record (``Entry.kept``
and ``_kept``, oldest promotion first): a restart then still finds it, and demoting it
again costs no write. A kept copy is space the SSD gives up first: a claim on the SSD
drops kept copies (of blocks no reader holds) before it evicts a block.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvstore.blocks import BlockHeader
from kvstore.errors import CapacityError, QuotaExceeded
from kvstore.events import BlockMoved, BlockRemoved, BlockStored, EventQueue
from kvstore.keys import BlockKey
from kvstore.node.budgets import Budget, Ledger, Usage
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import NO_PLACE, Tier
from kvstore.tiers.policy import EvictionPolicy, make_policy

__all__ = ["ROOM_WAIT_S", "BlockIndex", "Entry"]

log = logging.getLogger(__name__)

ROOM_WAIT_S = 2.0  # how long a claim waits for demotions in flight before CapacityError


class _State(IntEnum):
    READY = 0
    MOVING = 1  # being demoted or promoted; readable from its current place


@dataclass(slots=True, eq=False)
class Entry:
    """One stored block. Its fields belong to the index's lock: outside the index only
    ``key``, ``size`` and ``header`` (which never change) may be read, and ``place`` by
    the mover while the entry is MOVING for it (nothing else moves it then)."""

    key: bytes
    level: int  # index into the node's tiers, fastest first
    place: int  # where in that tier (an extent offset, or NO_PLACE)
    size: int  # header + payload bytes
    header: BlockHeader
    pins: int = 0
    state: _State = _State.READY
    gone: bool = False  # removed from the index while pinned or moving
    stale: list[tuple[int, int]] = field(default_factory=list)  # (level, place) to release
    used_at: float = 0.0  # time.monotonic() of the last store or hit (admin --older-than)
    kept: tuple[int, int] | None = None  # (level, place) of a clean copy in a lower tier


@dataclass(slots=True)
class Room:
    """What :meth:`BlockIndex.claim` found: a place, or a victim the caller must demote
    (already MOVING and pinned for it), or neither when the key is already stored."""

    place: int | None = None
    victim: Entry | None = None


class BlockIndex:
    """Key -> Entry for one node's tiers, their eviction order, pins and events."""

    def __init__(
        self, tiers: Sequence[Tier], policy: str, events: EventQueue, counters: NodeCounters
    ) -> None:
        self._tiers = tiers  # the node's list, fastest first; appended to while opening
        self._policy = policy
        self._events = events
        self._counters = counters
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a demotion ends
        self._entries: dict[Hashable, Entry] = {}
        self._policies: list[EvictionPolicy] = []
        self._demoting: list[int] = []  # per level: demotions out of it in flight
        self._writing: list[int] = []  # per level: reservations (puts) into it in flight
        self._room_waiters = 0  # writers waiting on _room
        self._kept: list[OrderedDict[bytes, Entry]] = []  # per level: kept copies there
        self._published: IndexWriter | None = None
        self._ledger = Ledger(lambda level: self._tiers[level].kind)

    # -- opening and closing ---------------------------------------------------------------

    def add_tier(self, tier: Tier) -> None:
        """Index a tier appended below the others (with its own policy), and the blocks
        it already holds (a persistent tier after a restart)."""
        with self._lock:
            self._policies.append(make_policy(self._policy, tier.capacity))
            self._demoting.append(0)
            self._writing.append(0)
            self._kept.append(OrderedDict())
            level = len(self._policies) - 1
        now = time.monotonic()
        for key, header in tier.stored():  # tier I/O: outside the lock
            size = header.total_len
            with self._lock:
                self._entries[key] = Entry(key, level, NO_PLACE, size, header, used_at=now)
                self._policies[level].insert(key, size)
                self._ledger.add(header.namespace_fp, level, key, size)
                self._events.put(BlockStored(key, tier.kind, size, header.namespace_fp))

    def publish(self, writer: IndexWriter | None) -> str:
        """Keep ``writer`` (the shared-memory index of the tier same-host readers map)
        in step from now on, starting with what that tier holds; returns the name of
        the index kept (an earlier one stays; None just asks for its name)."""
        with self._lock:
            if self._published is None and writer is not None:
                self._published = writer
                for e in self._entries.values():
                    self._publish_locked(e)
            elif writer is not None and writer is not self._published:
                writer.close()
            return "" if self._published is None else self._published.name

    @property
    def published(self) -> bool:
        """Whether a shared-memory index is kept in step."""
        return self._published is not None

    def close(self) -> IndexWriter | None:
        """Stop publishing; returns the writer for the caller to close."""
        with self._lock:
            writer, self._published = self._published, None
        return writer

    # -- queries ----------------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (any tier)."""
        with self._lock:
            return [k in self._entries for k in keys]

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._entries:
                    break
                n += 1
        return n

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        with self._lock:
            e = self._entries.get(key)
            return None if e is None else self._tiers[e.level].kind

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        with self._lock:
            return [
                BlockKey(e.key)
                for e in self._entries.values()
                if tier is None or self._tiers[e.level].kind is tier
            ]

    def snapshot(self) -> list[tuple[BlockKey, TierKind, int]]:
        """Every block with its tier and size, at one instant (for re-syncs)."""
        with self._lock:
            return [
                (BlockKey(e.key), self._tiers[e.level].kind, e.size) for e in self._entries.values()
            ]

    def scan(
        self, limit: int, tier: TierKind | None = None, flt: BlockFilter | None = None
    ) -> list[tuple[BlockKey, TierKind, int, bytes]]:
        """Up to ``limit`` blocks as (key, tier, size, namespace fingerprint), oldest
        stored first, those ``flt`` accepts."""
        now = time.monotonic()
        with self._lock:
            rows = (
                (BlockKey(e.key), self._tiers[e.level].kind, e.size, e.header.namespace_fp)
                for e in self._entries.values()
                if (tier is None or self._tiers[e.level].kind is tier)
                and (flt is None or flt.matches(e.key, e.header.namespace_fp, e.used_at, now))
            )
            return list(itertools.islice(rows, limit))

    def stats(self) -> tuple[dict[str, dict[str, int]], int]:
        """Per tier: capacity, used, blocks; plus the number of pinned blocks."""
        with self._lock:
            per = {
                t.kind.value: {"capacity": t.capacity, "used": t.used, "blocks": 0}
                for t in self._tiers
            }
            for e in self._entries.values():
                per[self._tiers[e.level].kind.value]["blocks"] += 1
            pinned = sum(1 for e in self._entries.values() if e.pins)
        return per, pinned

    # -- reads ------------------------------------------------------------------------------

    def pin(self, key: bytes, namespace_fp: bytes | None) -> tuple[Entry, int, int] | None:
        """Pin a block (a hit) and return it with its (level, place) now, or count a
        miss; a namespace mismatch is a miss."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                self._counters.inc("misses")
                return None
            if namespace_fp is not None and e.header.namespace_fp != namespace_fp:
                self._counters.inc("namespace_mismatch")
                self._counters.inc("misses")
                return None
            e.pins += 1
            e.used_at = time.monotonic()
            self._policies[e.level].touch(key)
            self._ledger.touch(e.header.namespace_fp, e.level, key)
            self._counters.inc(f"hits_{self._tiers[e.level].kind.value}")
            return e, e.level, e.place

    def unpin(self, e: Entry) -> None:
        """Unpin; places left behind by moves or removals are released at the last unpin."""
        with self._lock:
            e.pins -= 1
            if e.pins == 0:
                self._release_stale_locked(e)

    def touch(self, keys: Sequence[bytes]) -> int:
        """Count reads that happened without a pin (published-index readers) as DRAM hits
        and refresh each block's recency; returns how many are still stored."""
        now = time.monotonic()
        found = 0
        with self._lock:
            self._counters.inc("hits_dram", len(keys))
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    e.used_at = now
                    self._policies[e.level].touch(key)
                    self._ledger.touch(e.header.namespace_fp, e.level, key)
                    found += 1
        return found

    # -- writes -----------------------------------------------------------------------------

    def claim(
        self,
        level: int,
        size: int,
        unless_stored: bytes | None = None,
        *,
        fp: bytes | None = None,
        reservation: bool = False,
        spare_own: bool = False,
    ) -> Room:
        """Room for ``size`` bytes in tier ``level``: a place when the tier has it now,
        else a victim to demote (the last tier's kept copies, then its victims, are
        dropped here, until a place is found). With ``unless_stored``, an empty Room
        when that key is stored. A full tier with demotions out of it in flight is
        waited on (up to ROOM_WAIT_S); CapacityError when every block in the way is
        pinned or moving and nothing is on its way out.

        ``fp`` names the namespace the room is for: its budget (budgets.py) is applied
        first, and a victim it calls for is one of that budget's own blocks (with
        ``spare_own``, QuotaExceeded instead: room for a write credit is not worth
        one of the namespace's blocks). With ``reservation`` the place returned is
        counted as a write in flight until :meth:`commit` or :meth:`discard` is given
        it back."""
        tier = self._tiers[level]
        wait_until: float | None = None
        with self._lock:
            if unless_stored is not None and unless_stored in self._entries:
                return Room()
            while True:
                if fp is not None:
                    budget = self._ledger.over(fp, level, size, reservation=reservation)
                    if budget is not None and spare_own:
                        raise QuotaExceeded("no room for a write credit within the quota")
                    if budget is not None:
                        room = self._own_victim_locked(budget, level, size)
                        if room is not None:
                            return room
                        continue
                place = tier.allocate(size)
                if place is not None:
                    if reservation:
                        self._writing[level] += 1
                        if fp is not None:
                            self._ledger.reserve(fp, size)
                    return Room(place=place)
                if self._drop_kept_locked(level):
                    continue
                victim_key = self._policies[level].pop_victim(self._busy)
                if victim_key is None:
                    wait_until = self._wait_for_room_locked(level, wait_until)
                    if unless_stored is not None and unless_stored in self._entries:
                        return Room()
                    continue
                room = self._evict_locked(self._entries[victim_key], level)
                if room is not None:
                    return room

    def _own_victim_locked(self, budget: Budget, level: int, size: int) -> Room | None:
        """Make room within ``budget`` in tier ``level`` from its own least recently
        used block: a Room to demote it, or None when it was settled or dropped here.
        QuotaExceeded when none of its blocks there can go."""
        key = self._ledger.oldest(budget, level, self._busy, self._used_at)
        if key is None:
            kind = self._tiers[level].kind.value
            raise QuotaExceeded(
                f"{budget.name}: {size} more bytes would exceed its {kind} quota of "
                f"{budget.limit(self._tiers[level].kind)}, and its blocks there are all "
                "in use or being written"
            )
        self._counters.inc(f"quota_evictions_{self._tiers[level].kind.value}")
        self._policies[level].remove(key)
        return self._evict_locked(self._entries[key], level)

    def _used_at(self, key: bytes) -> float:
        return self._entries[key].used_at

    def _evict_locked(self, victim: Entry, level: int) -> Room | None:
        """Take a victim out of tier ``level`` (already out of its policy): settled on
        its kept copy or dropped here (None), or a Room for the caller to demote it."""
        if victim.kept is not None:
            self._settle_on_kept_locked(victim)  # its copy below is current
            return None
        if level + 1 < len(self._tiers):
            victim.state = _State.MOVING
            victim.pins += 1
            self._demoting[level] += 1
            return Room(victim=victim)
        self._counters.inc(f"evictions_{self._tiers[level].kind.value}")  # it leaves the node
        self._drop_locked(victim)
        return None

    def _wait_for_room_locked(self, level: int, wait_until: float | None) -> float:
        """Wait for a demotion out of ``level``, or a write into it, to end (a committed
        write is a block that can be demoted); CapacityError when neither is in flight or
        the wait ran out. Returns the wait's end (the same for every round)."""
        now = time.monotonic()
        wait_until = now + ROOM_WAIT_S if wait_until is None else wait_until
        if not (self._demoting[level] or self._writing[level]) or now >= wait_until:
            kind = self._tiers[level].kind.value
            raise CapacityError(
                f"{kind} tier is full: every block in it is pinned or moving, the rest of "
                "it is held by writes in flight"
            )
        self._counters.inc("room_waits")
        self._room_waiters += 1
        try:
            self._room.wait(wait_until - now)
        finally:
            self._room_waiters -= 1
        return wait_until

    def _busy(self, key: Hashable) -> bool:
        e = self._entries.get(key)
        return e is None or e.pins > 0 or e.state is not _State.READY

    def commit(self, key: bytes, level: int, place: int, header: BlockHeader) -> bool:
        """Make a filled, sealed block visible (its reservation, claimed with
        ``reservation``, ends). False (its place released) when the key was stored
        meanwhile: keys name content, the first copy stays."""
        size = header.total_len
        with self._lock:
            self._ledger.unreserve(header.namespace_fp, size)
            self._end_write_locked(level)
            if key in self._entries:
                self._tiers[level].release(key, place)
                return False
            e = Entry(key, level, place, size, header, used_at=time.monotonic())
            self._entries[key] = e
            self._publish_locked(e)
            self._policies[level].insert(key, size)
            self._ledger.add(header.namespace_fp, level, key, size)
            self._events.put(BlockStored(key, self._tiers[level].kind, size, header.namespace_fp))
        return True

    def discard(
        self, key: bytes, level: int, place: int, reserved: tuple[bytes, int] | None = None
    ) -> None:
        """Release a place that never became (or no longer is) a visible block's;
        ``reserved`` = (namespace fp, size) ends the reservation it was claimed for."""
        with self._lock:
            if reserved is not None:
                self._ledger.unreserve(*reserved)
                self._end_write_locked(level)
            self._discard_locked(key, level, place)

    def _end_write_locked(self, level: int) -> None:
        self._writing[level] = max(self._writing[level] - 1, 0)
        if self._room_waiters:  # the common case, nobody waiting, costs no notify
            self._room.notify_all()

    def _discard_locked(self, key: bytes, level: int, place: int) -> None:
        if place != NO_PLACE or not self._holds(key, level):
            self._tiers[level].release(key, place)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget blocks; returns how many were present. Pinned ones' places are
        released at their last unpin."""
        n = 0
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    self._drop_locked(e)
                    n += 1
        return n

    # -- moves (the mover's steps; each one acquisition) ----------------------------------

    def end_demotion(self, e: Entry, dst_level: int, place: int | None) -> None:
        """A victim's copy one tier down is done (``place``) or failed (None: dropped)."""
        src = self._tiers[e.level]
        with self._lock:
            e.state = _State.READY
            e.pins -= 1
            self._demoting[e.level] -= 1
            self._room.notify_all()
            if place is not None and e.kept is not None and e.kept[0] == dst_level:
                self._kept[dst_level].pop(e.key, None)  # rewritten there: it is the copy
                e.kept = None
            if place is None or e.gone:
                if not e.gone:
                    self._counters.inc(f"evictions_{src.kind.value}")
                    self._drop_locked(e)
                elif place is not None:
                    self._discard_locked(e.key, dst_level, place)
                return
            self._move_locked(e, dst_level, place)
            self._counters.inc(f"demotions_{src.kind.value}")
            self._counters.inc(f"bytes_demoted_{src.kind.value}", e.size)
            if e.pins == 0:
                self._release_stale_locked(e)

    def begin_promotion(self, e: Entry, level: int) -> bool:
        """Mark a pinned block read from ``level`` as moving up, when it may."""
        with self._lock:
            promote = e.state is _State.READY and not e.gone and e.level == level
            if promote:
                e.state = _State.MOVING
            return promote

    def end_promotion(self, e: Entry, place: int | None, ok: bool) -> bool:
        """After a promoting read: ``ok`` False means the bytes were unreadable (the block
        is dropped, ``place`` released), ``place`` None that there was no room. Returns
        whether the block now lives at ``place`` in the top tier; when it was removed
        meanwhile, False and the caller still owns ``place`` (to copy out, then discard)."""
        with self._lock:
            e.state = _State.READY
            if not ok:
                if place is not None:
                    self._tiers[0].release(e.key, place)
                if not e.gone:
                    self._drop_locked(e)
                return False
            if place is None:
                return False
            if e.gone:
                return False
            self._policies[e.level].remove(e.key)
            self._move_locked(e, 0, place, keep=e.place == NO_PLACE)
            self._counters.inc("promotions")
            self._counters.inc("bytes_promoted", e.size)
        return True

    def _move_locked(self, e: Entry, level: int, place: int, *, keep: bool = False) -> None:
        """Point ``e`` at ``place`` in tier ``level``; the old place is released (at the
        last unpin), or with ``keep`` (a key-addressed tier: SSD) stays as its copy."""
        src = self._tiers[e.level]  # its policy let go of it already
        self._unpublish_locked(e)
        fp = e.header.namespace_fp
        self._ledger.remove(fp, e.level, e.key, e.size)
        self._ledger.add(fp, level, e.key, e.size)
        if keep:
            e.kept = (e.level, e.place)
            self._kept[e.level][e.key] = e
        else:
            e.stale.append((e.level, e.place))
        e.level, e.place = level, place
        self._publish_locked(e)
        self._policies[level].insert(e.key, e.size)
        self._events.put(BlockMoved(e.key, src.kind, self._tiers[level].kind))

    def _settle_on_kept_locked(self, e: Entry) -> None:
        """Demote a victim (popped from its policy, unpinned) by pointing it at its kept
        copy: no bytes move."""
        assert e.kept is not None
        level, place = e.kept
        src = self._tiers[e.level].kind.value
        self._kept[level].pop(e.key, None)
        e.kept = None
        self._move_locked(e, level, place)
        self._counters.inc(f"demotions_{src}")
        self._counters.inc("kept_copies_reused")
        if e.pins == 0:
            self._release_stale_locked(e)

    def _drop_kept_locked(self, level: int) -> bool:
        """Give up the oldest kept copy in tier ``level`` that no reader may be using;
        False when there is none."""
        kept = self._kept[level]
        for key, e in kept.items():
            if e.pins == 0 and e.state is _State.READY:
                del kept[key]
                assert e.kept is not None
                self._tiers[level].release(key, e.kept[1])
                e.kept = None
                self._counters.inc("kept_copies_dropped")
                return True
        return False

    def drop_kept(self, level: int, target: int) -> int:
        """Give up kept copies in tier ``level`` until it uses at most ``target`` bytes
        (an admin eviction, before it evicts blocks); returns how many went."""
        n = 0
        with self._lock:
            while self._tiers[level].used > target and self._drop_kept_locked(level):
                n += 1
        return n

    def plan_eviction(
        self, level: int, target: int, flt: BlockFilter, skipped: set[bytes]
    ) -> tuple[list[tuple[bytes, int]], int]:
        """Candidates (key, size) in eviction order until the projected use of tier
        ``level`` reaches ``target``, and that projected use; pinned or moving
        candidates go to ``skipped``."""
        now = time.monotonic()
        with self._lock:
            projected = self._tiers[level].used
            plan: list[tuple[bytes, int]] = []
            for key in self._policies[level]:
                if projected <= target:
                    break
                e = self._entries.get(key)
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

    def take_for_eviction(
        self, level: int, key: bytes, target: int, res: EvictResult, skipped: set[bytes]
    ) -> Entry | bool:
        """One planned block: dropped here from the last tier or settled on its kept
        copy below (True, counted in ``res``), or returned MOVING and pinned for the
        caller to demote; False when the target is met or the block moved, went, or is
        pinned now."""
        tier = self._tiers[level]
        with self._lock:
            if tier.used <= target:
                return False
            e = self._entries.get(key)
            if e is None or e.level != level:
                return False
            if e.pins > 0 or e.state is not _State.READY:
                skipped.add(key)
                return False
            self._policies[level].remove(key)
            res.nbytes += e.size
            if not res.next_tier:
                self._counters.inc(f"evictions_{tier.kind.value}")
                self._drop_locked(e)
                res.dropped += 1
                return True
            if e.kept is not None:
                self._settle_on_kept_locked(e)
                res.demoted += 1
                return True
            e.state, e.pins = _State.MOVING, e.pins + 1
            self._demoting[level] += 1
            return e

    # -- budgets ------------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Install or replace (by name) the budget of a set of namespaces."""
        with self._lock:
            self._ledger.set_budget(budget)

    def usage(self, budget: Budget) -> Usage:
        """What a budget's namespaces hold now, per tier, and their writes in flight."""
        with self._lock:
            return self._ledger.usage(budget, len(self._tiers))

    # -- under the lock -----------------------------------------------------------------------

    def _holds(self, key: bytes, level: int) -> bool:
        cur = self._entries.get(key)
        return cur is not None and cur.level == level

    def _drop_locked(self, e: Entry) -> None:
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        e.gone = True
        self._unpublish_locked(e)
        self._policies[e.level].remove(e.key)
        self._ledger.remove(e.header.namespace_fp, e.level, e.key, e.size)
        self._events.put(BlockRemoved(e.key, self._tiers[e.level].kind))
        e.stale.append((e.level, e.place))
        if e.kept is not None:  # its copy below goes too
            self._kept[e.kept[0]].pop(e.key, None)
            e.stale.append(e.kept)
            e.kept = None
        if e.pins == 0:
            self._release_stale_locked(e)

    def _release_stale_locked(self, e: Entry) -> None:
        while e.stale:
            level, place = e.stale.pop()
            self._discard_locked(e.key, level, place)

    def _publish_locked(self, e: Entry) -> None:
        w = self._published
        if (
            w is not None
            and self._tiers[e.level].shm_name is not None
            and not w.publish(e.key, e.place)
        ):
            self._counters.inc("shm_index_full")  # its reads take a lease instead

    def _unpublish_locked(self, e: Entry) -> None:
        """Before a shared extent is left (released now or at the last unpin): readers
        that copy without a pin check the index after copying (kvstore/shm/index.py)."""
        if self._published is not None and self._tiers[e.level].shm_name is not None:
            self._published.unpublish(e.key)
