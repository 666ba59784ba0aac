"""TierMover: the bytes of blocks moving between one node's tiers.

A full tier makes room by demoting its policy's victim one tier down (HBM -> DRAM ->
SSD); the last tier drops it. An SSD hit is promoted back to the top tier, and its SSD
record stays as a kept copy (so a restart still has it, and demoting it again writes
nothing) until the SSD needs the room (kvstore/node/state.py). Admin evictions demote
or drop what a filter selects. A block is read from exactly one tier. A block leaving
a device tier (HBM) is hashed as it lands below and checked (kvstore/tiers/hbm.py):
the header stored below carries that checksum, and the index takes it with the move;
bytes that fail it are not stored, the block is dropped and counted
(``corrupt_blocks_<tier>``). The mover asks
the index for every decision (claims.py for room, moves.py for each step of a move)
and copies bytes only between its calls, never under the index's lock: see the
contract in state.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvstore.blocks import BlockHeader
from kvstore.errors import (
    BlockTooLarge,
    CapacityError,
    CorruptBlock,
    KVStoreError,
    NotFound,
    QuotaExceeded,
)
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.node.index import BlockIndex
from kvstore.node.state import Entry
from kvstore.observe.counters import NodeCounters
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import HostPayload, Payload, Tier

__all__ = ["TierMover"]

log = logging.getLogger(__name__)

_ROUNDS = 1 << 16  # victims one make_room may demote before giving up


class TierMover:
    """Room-making, demotion, promotion and admin eviction over a node's tiers."""

    def __init__(self, tiers: Sequence[Tier], index: BlockIndex, counters: NodeCounters) -> None:
        self._tiers = tiers
        self._index = index
        self._claims = index.claims
        self._moves = index.moves
        self._counters = counters

    def make_room(
        self,
        level: int,
        size: int,
        unless_stored: bytes | None = None,
        *,
        fp: bytes | None = None,
        reservation: bool = False,
        spare_own: bool = False,
    ) -> int | None:
        """A place for ``size`` bytes in tier ``level``, demoting victims one tier down
        (outside the index's lock) until there is one. None when ``unless_stored`` is
        given and that key is stored. BlockTooLarge when it could never fit.
        ``fp``, ``reservation`` and ``spare_own``: see Claims.claim (a namespace's
        budget)."""
        tier = self._tiers[level]
        if not tier.fits_ever(size):
            raise BlockTooLarge(f"block of {size} bytes exceeds the {tier.kind.value} tier")
        for _ in range(_ROUNDS):
            room = self._claims.claim(
                level, size, unless_stored, fp=fp, reservation=reservation, spare_own=spare_own
            )
            if room.victim is None:
                return room.place
            self._demote(room.victim, level)
        raise CapacityError(f"could not free {size} bytes in the {tier.kind.value} tier")

    def _demote(self, e: Entry, level: int) -> None:
        """Copy a victim (MOVING, pinned for us) from ``level`` one tier down, or drop it."""
        place: int | None = None
        header = None
        try:
            place, header = self._copy_down(e, level)
        except QuotaExceeded:  # its namespace has no room below: it leaves the node
            self._counters.inc("quota_drops")
        except CorruptBlock as exc:
            self._counters.inc(f"corrupt_blocks_{self._tiers[level].kind.value}")
            log.warning("demotion of %s found it corrupt, dropping it: %s", e.key.hex(), exc)
        except KVStoreError as exc:
            log.warning("demotion of %s failed, dropping it: %s", e.key.hex(), exc)
        finally:  # whatever happened, the victim stops MOVING and waiters are woken
            self._moves.end_demotion(e, level + 1, place, header)

    def _copy_down(self, e: Entry, level: int) -> tuple[int, BlockHeader]:
        src = self._tiers[level].payload(e.place, e.header.payload_len)
        if src is None:
            raise CapacityError(f"the {self._tiers[level].kind.value} tier cannot demote")
        dst_level = level + 1
        dst = self._tiers[dst_level]
        fp = e.header.namespace_fp
        for _attempt in range(3):
            place = self.make_room(dst_level, e.size, fp=fp)
            assert place is not None
            try:
                return place, dst.store(e.key, place, e.header, src)
            except CapacityError:
                continue  # another writer took the room between check and write
            except CorruptBlock:  # nothing was stored: the room goes back
                self._index.discard(e.key, dst_level, place)
                raise
        raise CapacityError(f"no room in the {dst.kind.value} tier after 3 tries")

    def read_through(self, e: Entry, level: int) -> tuple[Payload, int] | None:
        """Read a pinned block from a tier that only copies out (SSD), verified, and
        promote it to the top tier when there is room.

        Returns (payload, place): the top tier's bytes and their place after a
        promotion, else a private buffer and -1. None when the bytes are unreadable or
        gone (counted; the block is dropped).
        """
        n = e.header.payload_len
        promote = self._moves.begin_promotion(e, level)
        place: int | None = None
        if promote:
            try:
                place = self.make_room(0, e.size, fp=e.header.namespace_fp)
            except KVStoreError:
                place = None
        top = self._tiers[0]
        dst = top.payload(place, n) if place is not None else None
        if dst is None:
            dst = HostPayload(np.empty(n, dtype=np.uint8))
        try:
            self._tiers[level].load(e.key, e.place, e.header, dst)
        except (CorruptBlock, NotFound) as exc:
            self._counters.inc("corrupt_blocks" if isinstance(exc, CorruptBlock) else "lost_blocks")
            kind = self._tiers[level].kind.value
            log.warning("%s block %s unreadable: %s", kind, e.key.hex(), exc)
            self._moves.end_promotion(e, place, ok=False)
            return None
        if not promote:
            return dst, -1
        if place is not None:
            top.seal(place, e.header)
        if self._moves.end_promotion(e, place, ok=True):
            assert place is not None
            return dst, place
        if place is None:
            return dst, -1
        copy = HostPayload(np.array(dst.host()))  # removed meanwhile: a private copy,
        self._index.discard(e.key, 0, place)  # taken before its place goes back
        return copy, -1

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

        Tiers with one below demote to it, the last tier drops. Pinned (or moving)
        candidates are never taken; they are counted in ``skipped_pinned``. A dry run
        plans and changes nothing. The plan is made under the index's lock and carried
        out one block at a time (each re-checked, demotion I/O outside the lock), in
        rounds, because writers may fill the tier meanwhile.
        """
        flt = flt or BlockFilter()
        level = [t.kind for t in self._tiers].index(tier)
        demotes = level + 1 < len(self._tiers)
        res = EvictResult(tier.value, self._tiers[level].capacity, self._tiers[level].used)
        res.dry_run = dry_run
        res.next_tier = self._tiers[level + 1].kind.value if demotes else ""
        skipped: set[bytes] = set()
        if not demotes and not dry_run:  # copies of promoted blocks go before blocks
            self._moves.drop_kept(level, target_bytes)
        for _round in range(64):
            plan, projected = self._moves.plan_eviction(level, target_bytes, flt, skipped)
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
            res.used_after = self._tiers[level].used
        return res

    def _evict_one(
        self, level: int, key: bytes, target: int, res: EvictResult, skipped: set[bytes]
    ) -> bool:
        taken = self._moves.take_for_eviction(level, key, target, res, skipped)
        if isinstance(taken, bool):  # dropped or settled (counted), or nothing done
            return taken
        self._demote(taken, level)
        res.demoted += 1
        return True
