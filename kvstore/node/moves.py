"""MoveSteps: the index's half of every move between a node's tiers.

The mover (mover.py) copies a block's bytes; before and after each copy it asks here
what may move and records what did: a demotion's end, a promotion's start and end, an
admin eviction's plan and each block it takes. Each step takes the index's lock once
and does no I/O (state.py, the contract).
"""

from __future__ import annotations

import time

from kvstore.blocks import BlockHeader
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.node.state import Entry, EntryState, IndexState
from kvstore.tiers.base import NO_PLACE

__all__ = ["MoveSteps"]


class MoveSteps:
    """Demotion, promotion and admin-eviction steps over the index's state."""

    def __init__(self, state: IndexState) -> None:
        self._s = state

    def end_demotion(
        self, e: Entry, dst_level: int, place: int | None, header: BlockHeader | None = None
    ) -> None:
        """A victim's copy one tier down is done (``place``, stored with ``header``: its
        checksum settled when it left a device) or failed (None: dropped)."""
        s = self._s
        src = s.tiers[e.level]
        with s.lock:
            e.state = EntryState.READY
            e.pins -= 1
            s.demoting[e.level] -= 1
            s.room.notify_all()
            if place is not None and e.kept is not None and e.kept[0] == dst_level:
                s.kept[dst_level].pop(e.key, None)  # rewritten there: it is the copy
                e.kept = None
            if place is None or e.gone:
                if not e.gone:
                    s.counters.inc(f"evictions_{src.kind.value}")
                    s.drop_locked(e)
                elif place is not None:
                    s.discard_locked(e.key, dst_level, place)
                return
            s.move_locked(e, dst_level, place, header=header)
            s.counters.inc(f"demotions_{src.kind.value}")
            s.counters.inc(f"bytes_demoted_{src.kind.value}", e.size)
            if e.pins == 0:
                s.release_stale_locked(e)

    def begin_promotion(self, e: Entry, level: int) -> bool:
        """Mark a pinned block read from ``level`` as moving up, when it may."""
        with self._s.lock:
            promote = e.state is EntryState.READY and not e.gone and e.level == level
            if promote:
                e.state = EntryState.MOVING
            return promote

    def end_promotion(self, e: Entry, place: int | None, ok: bool) -> bool:
        """After a promoting read: ``ok`` False means the bytes were unreadable (the block
        is dropped, ``place`` released), ``place`` None that there was no room. Returns
        whether the block now lives at ``place`` in the top tier; when it was removed
        meanwhile, False and the caller still owns ``place`` (to copy out, then discard)."""
        s = self._s
        with s.lock:
            e.state = EntryState.READY
            if not ok:
                if place is not None:
                    s.tiers[0].release(e.key, place)
                if not e.gone:
                    s.drop_locked(e)
                return False
            if place is None:
                return False
            if e.gone:
                return False
            s.policies[e.level].remove(e.key)
            s.move_locked(e, 0, place, keep=e.place == NO_PLACE)
            s.counters.inc("promotions")
            s.counters.inc("bytes_promoted", e.size)
        return True

    def drop_kept(self, level: int, target: int) -> int:
        """Give up kept copies in tier ``level`` until it uses at most ``target`` bytes
        (an admin eviction, before it evicts blocks); returns how many went."""
        s = self._s
        n = 0
        with s.lock:
            while s.tiers[level].used > target and s.drop_kept_locked(level):
                n += 1
        return n

    def plan_eviction(
        self, level: int, target: int, flt: BlockFilter, skipped: set[bytes]
    ) -> tuple[list[tuple[bytes, int]], int]:
        """Candidates (key, size) in eviction order until the projected use of tier
        ``level`` reaches ``target``, and that projected use; pinned or moving
        candidates go to ``skipped``."""
        s = self._s
        now = time.monotonic()
        with s.lock:
            projected = s.tiers[level].used
            plan: list[tuple[bytes, int]] = []
            for key in s.policies[level]:
                if projected <= target:
                    break
                e = s.entries.get(key)
                if e is None or e.level != level:
                    continue
                if not flt.matches(e.key, e.header.namespace_fp, e.used_at, now):
                    continue
                if e.pins > 0 or e.state is not EntryState.READY:
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
        s = self._s
        tier = s.tiers[level]
        with s.lock:
            if tier.used <= target:
                return False
            e = s.entries.get(key)
            if e is None or e.level != level:
                return False
            if e.pins > 0 or e.state is not EntryState.READY:
                skipped.add(key)
                return False
            s.policies[level].remove(key)
            res.nbytes += e.size
            if not res.next_tier:
                s.counters.inc(f"evictions_{tier.kind.value}")
                s.drop_locked(e)
                res.dropped += 1
                return True
            if e.kept is not None:
                s.settle_on_kept_locked(e)
                res.demoted += 1
                return True
            e.state, e.pins = EntryState.MOVING, e.pins + 1
            s.demoting[level] += 1
            return e
