"""IndexState: everything the node's one lock guards, and the steps taken under it.

The block index of one node is one lock over one state, seen through three faces that
each take the lock themselves: BlockIndex (index.py: queries, reads, commits, removals,
publishing, budgets), Claims (claims.py: room for a block in a tier, the allocator)
and MoveSteps (moves.py: the index's half of demotions, promotions and evictions). The
state and its contract live here, so that the three read the same rules.

Concurrency contract. ``IndexState.lock`` (one plain Lock) guards:
- ``entries`` and every field of every Entry;
- the per-tier policies, kept copies, demotions and writes in flight, the ledger, the
  published DRAM index and the order of events;
- the tiers' space: ``Tier.allocate`` and ``Tier.release`` are called only under it.
Every public method of the three faces takes the lock at most once and returns with it
released; callers never hold it. Every method of IndexState expects it held (those
that change the state end in ``_locked``). Byte copies (a reservation's fill, a read's
copy, demotion and promotion I/O) run OUTSIDE it, on places kept alive by a pin
(``Entry.pins``), a reservation, or the MOVING state. An entry with ``pins > 0`` or
``state != READY`` is never a victim. A place a pinned reader may still use is not
released when its entry moves or goes: it joins ``Entry.stale`` and is released at the
last unpin, so readers never see freed or reused bytes. Lock order: this lock, then a
tier's own (the SSD tier's index lock); a tier never calls back into the index.

Kept copies. Promoting an SSD block to the top tier keeps its SSD record (``Entry.kept``
and ``kept``, oldest promotion first): a restart then still finds it, and demoting it
again costs no write. A kept copy is space the SSD gives up first: a claim on the SSD
drops kept copies (of blocks no reader holds) before it evicts a block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvstore.blocks import BlockHeader
from kvstore.events import BlockMoved, BlockRemoved, EventQueue
from kvstore.node.budgets import Ledger
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tiers.base import NO_PLACE, Tier
from kvstore.tiers.policy import EvictionPolicy, make_policy

__all__ = ["Entry", "EntryState", "IndexState"]


class EntryState(IntEnum):
    READY = 0
    MOVING = 1  # being demoted or promoted; readable from its current place


@dataclass(slots=True, eq=False)
class Entry:
    """One stored block. Its fields belong to the index's lock: outside the index only
    ``key``, ``size`` and ``header`` may be read, and ``place`` by the mover while the
    entry is MOVING for it (nothing else moves it then). ``key`` and ``size`` never
    change; ``header`` changes at most once, under the lock, when a block put into a
    device tier with its checksum pending is demoted and the header stored below
    carries the checksum it left with (an attribute read sees the old or the new
    one, each whole)."""

    key: bytes
    level: int  # index into the node's tiers, fastest first
    place: int  # where in that tier (an extent offset, or NO_PLACE)
    size: int  # header + payload bytes
    header: BlockHeader
    pins: int = 0
    state: EntryState = EntryState.READY
    gone: bool = False  # removed from the index while pinned or moving
    stale: list[tuple[int, int]] = field(default_factory=list)  # (level, place) to release
    used_at: float = 0.0  # time.monotonic() of the last store or hit (admin --older-than)
    kept: tuple[int, int] | None = None  # (level, place) of a clean copy in a lower tier


class IndexState:
    """Key -> Entry for one node's tiers, with their eviction order, the counts of moves
    and writes in flight, kept copies, the budgets' ledger and the published index."""

    def __init__(self, tiers: Sequence[Tier], events: EventQueue, counters: NodeCounters) -> None:
        self.tiers = tiers  # the node's list, fastest first; appended to while opening
        self.events = events
        self.counters = counters
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # notified when a demotion or write ends
        self.entries: dict[Hashable, Entry] = {}
        self.policies: list[EvictionPolicy] = []
        self.demoting: list[int] = []  # per level: demotions out of it in flight
        self.writing: list[int] = []  # per level: reservations (puts) into it in flight
        self.room_waiters = 0  # writers waiting on room
        self.kept: list[OrderedDict[bytes, Entry]] = []  # per level: kept copies there
        self.published: IndexWriter | None = None
        self.ledger = Ledger(lambda level: self.tiers[level].kind)

    def add_level_locked(self, policy: str, capacity: int) -> int:
        """Books for a tier appended below the others; returns its level."""
        self.policies.append(make_policy(policy, capacity))
        self.demoting.append(0)
        self.writing.append(0)
        self.kept.append(OrderedDict())
        return len(self.policies) - 1

    # -- looks --------------------------------------------------------------------------

    def holds(self, key: bytes, level: int) -> bool:
        cur = self.entries.get(key)
        return cur is not None and cur.level == level

    def busy(self, key: Hashable) -> bool:
        """Whether a block may not be a victim now (absent, pinned or moving)."""
        e = self.entries.get(key)
        return e is None or e.pins > 0 or e.state is not EntryState.READY

    def used_at(self, key: bytes) -> float:
        return self.entries[key].used_at

    # -- steps --------------------------------------------------------------------------

    def end_write_locked(self, level: int) -> None:
        self.writing[level] = max(self.writing[level] - 1, 0)
        if self.room_waiters:  # the common case, nobody waiting, costs no notify
            self.room.notify_all()

    def discard_locked(self, key: bytes, level: int, place: int) -> None:
        if place != NO_PLACE or not self.holds(key, level):
            self.tiers[level].release(key, place)

    def drop_locked(self, e: Entry) -> None:
        """Forget a block; its places go now, or at its last unpin."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        e.gone = True
        self.unpublish_locked(e)
        self.policies[e.level].remove(e.key)
        self.ledger.remove(e.header.namespace_fp, e.level, e.key, e.size)
        self.events.put(BlockRemoved(e.key, self.tiers[e.level].kind))
        e.stale.append((e.level, e.place))
        if e.kept is not None:  # its copy below goes too
            self.kept[e.kept[0]].pop(e.key, None)
            e.stale.append(e.kept)
            e.kept = None
        if e.pins == 0:
            self.release_stale_locked(e)

    def release_stale_locked(self, e: Entry) -> None:
        while e.stale:
            level, place = e.stale.pop()
            self.discard_locked(e.key, level, place)

    def move_locked(
        self,
        e: Entry,
        level: int,
        place: int,
        *,
        keep: bool = False,
        header: BlockHeader | None = None,
    ) -> None:
        """Point ``e`` at ``place`` in tier ``level``; the old place is released (at the
        last unpin), or with ``keep`` (a key-addressed tier: SSD) stays as its copy.
        ``header``: the one the block was stored with there (its checksum settled)."""
        src = self.tiers[e.level]  # its policy let go of it already
        self.unpublish_locked(e)
        fp = e.header.namespace_fp
        self.ledger.remove(fp, e.level, e.key, e.size)
        self.ledger.add(fp, level, e.key, e.size)
        if keep:
            e.kept = (e.level, e.place)
            self.kept[e.level][e.key] = e
        else:
            e.stale.append((e.level, e.place))
        e.level, e.place = level, place
        if header is not None:
            e.header = header
        self.publish_locked(e)
        self.policies[level].insert(e.key, e.size)
        self.events.put(BlockMoved(e.key, src.kind, self.tiers[level].kind))

    def settle_on_kept_locked(self, e: Entry) -> None:
        """Demote a victim (popped from its policy, unpinned) by pointing it at its kept
        copy: no bytes move."""
        assert e.kept is not None
        level, place = e.kept
        src = self.tiers[e.level].kind.value
        self.kept[level].pop(e.key, None)
        e.kept = None
        self.move_locked(e, level, place)
        self.counters.inc(f"demotions_{src}")
        self.counters.inc("kept_copies_reused")
        if e.pins == 0:
            self.release_stale_locked(e)

    def drop_kept_locked(self, level: int) -> bool:
        """Give up the oldest kept copy in tier ``level`` that no reader may be using;
        False when there is none."""
        kept = self.kept[level]
        for key, e in kept.items():
            if e.pins == 0 and e.state is EntryState.READY:
                del kept[key]
                assert e.kept is not None
                self.tiers[level].release(key, e.kept[1])
                e.kept = None
                self.counters.inc("kept_copies_dropped")
                return True
        return False

    # -- the published index of the shared tier ------------------------------------------

    def publish_locked(self, e: Entry) -> None:
        w = self.published
        if (
            w is not None
            and self.tiers[e.level].shm_name is not None
            and not w.publish(e.key, e.place)
        ):
            self.counters.inc("shm_index_full")  # its reads take a lease instead

    def unpublish_locked(self, e: Entry) -> None:
        """Before a shared extent is left (released now or at the last unpin): readers
        that copy without a pin check the index after copying (kvstore/shm/index.py)."""
        if self.published is not None and self.tiers[e.level].shm_name is not None:
            self.published.unpublish(e.key)
