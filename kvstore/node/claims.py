"""Claims: room for a block in one tier of a node, the allocator over the tiers' own.

A claim asks the tier for a place; when the tier is full it gives up the tier's kept
copies (state.py), then names a victim by the tier's eviction policy: the last tier
drops it here, any other hands it to the mover (mover.py) to demote, MOVING and
pinned, and the mover claims again once it is down. Each claim takes the index's lock
once (state.py, the contract), more only when it waits for room.

Waiting for room. A writer that finds a tier full and every block in it pinned or
MOVING does not fail while demotions out of that tier, or writes into it, are in
flight (``IndexState.demoting``, ``writing``: a committed write is a block that can be
demoted): it waits on ``IndexState.room`` (a Condition over the lock, notified as each
demotion or write ends) for up to ``ROOM_WAIT_S``, then looks again. Only a tier with
nothing on its way in or out is reported full (CapacityError, retryable).

Budgets. A set of namespaces may have a Budget (budgets.py: a tenant's quota as the
server hands it down); the index's Ledger keeps each namespace's bytes and blocks per
tier and its writes in flight, under the same lock, and ``claim`` applies the budget
of the namespace it claims for: past its writes in flight, QuotaExceeded; past its
bytes in the tier, its own least recently used block there is the victim, never
another namespace's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstore.errors import CapacityError, QuotaExceeded
from kvstore.node.budgets import Budget
from kvstore.node.state import Entry, EntryState, IndexState

__all__ = ["ROOM_WAIT_S", "Claims", "Room"]

ROOM_WAIT_S = 2.0  # how long a claim waits for demotions in flight before CapacityError


@dataclass(slots=True)
class Room:
    """What :meth:`Claims.claim` found: a place, or a victim the caller must demote
    (already MOVING and pinned for it), or neither when the key is already stored."""

    place: int | None = None
    victim: Entry | None = None


class Claims:
    """Places in a node's tiers, made by eviction when they are full."""

    def __init__(self, state: IndexState) -> None:
        self._s = state

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
        counted as a write in flight until BlockIndex.commit or BlockIndex.discard is
        given it back."""
        s = self._s
        tier = s.tiers[level]
        wait_until: float | None = None
        with s.lock:
            if unless_stored is not None and unless_stored in s.entries:
                return Room()
            while True:
                if fp is not None:
                    budget = s.ledger.over(fp, level, size, reservation=reservation)
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
                        s.writing[level] += 1
                        if fp is not None:
                            s.ledger.reserve(fp, size)
                    return Room(place=place)
                if s.drop_kept_locked(level):
                    continue
                victim_key = s.policies[level].pop_victim(s.busy)
                if victim_key is None:
                    wait_until = self._wait_for_room_locked(level, wait_until)
                    if unless_stored is not None and unless_stored in s.entries:
                        return Room()
                    continue
                room = self._evict_locked(s.entries[victim_key], level)
                if room is not None:
                    return room

    def _own_victim_locked(self, budget: Budget, level: int, size: int) -> Room | None:
        """Make room within ``budget`` in tier ``level`` from its own least recently
        used block: a Room to demote it, or None when it was settled or dropped here.
        QuotaExceeded when none of its blocks there can go."""
        s = self._s
        key = s.ledger.oldest(budget, level, s.busy, s.used_at)
        if key is None:
            kind = s.tiers[level].kind.value
            raise QuotaExceeded(
                f"{budget.name}: {size} more bytes would exceed its {kind} quota of "
                f"{budget.limit(s.tiers[level].kind)}, and its blocks there are all "
                "in use or being written"
            )
        s.counters.inc(f"quota_evictions_{s.tiers[level].kind.value}")
        s.policies[level].remove(key)
        return self._evict_locked(s.entries[key], level)

    def _evict_locked(self, victim: Entry, level: int) -> Room | None:
        """Take a victim out of tier ``level`` (already out of its policy): settled on
        its kept copy or dropped here (None), or a Room for the caller to demote it."""
        s = self._s
        if victim.kept is not None:
            s.settle_on_kept_locked(victim)  # its copy below is current
            return None
        if level + 1 < len(s.tiers):
            victim.state = EntryState.MOVING
            victim.pins += 1
            s.demoting[level] += 1
            return Room(victim=victim)
        s.counters.inc(f"evictions_{s.tiers[level].kind.value}")  # it leaves the node
        s.drop_locked(victim)
        return None

    def _wait_for_room_locked(self, level: int, wait_until: float | None) -> float:
        """Wait for a demotion out of ``level``, or a write into it, to end (a committed
        write is a block that can be demoted); CapacityError when neither is in flight or
        the wait ran out. Returns the wait's end (the same for every round)."""
        s = self._s
        now = time.monotonic()
        wait_until = now + ROOM_WAIT_S if wait_until is None else wait_until
        if not (s.demoting[level] or s.writing[level]) or now >= wait_until:
            kind = s.tiers[level].kind.value
            raise CapacityError(
                f"{kind} tier is full: every block in it is pinned or moving, the rest of "
                "it is held by writes in flight"
            )
        s.counters.inc("room_waits")
        s.room_waiters += 1
        try:
            s.room.wait(wait_until - now)
        finally:
            s.room_waiters -= 1
        return wait_until
