"""Budgets: limits on what a set of namespaces may hold on one node, and their ledger.

The node never sees tenants: a block carries only its namespace fingerprint. A server
that gives a tenant a quota (kvstore/server/quotas.py) hands the node a :class:`Budget`:
the fingerprints of that tenant's namespaces and the limits they share. The node keeps,
per fingerprint, the bytes held in each tier (with those blocks in recency order) and
the reservations in flight, and checks a budget when one of its namespaces claims room:

- a new reservation over the budget's count or bytes in flight is refused
  (QuotaExceeded) before anything is reserved;
- a claim that would take the budget over its bytes in a tier makes room from the
  budget's OWN blocks in that tier first, least recently used first (demoted one tier
  down, or dropped from the last tier), never from another namespace's; when none of
  its own can go (all pinned or moving), the claim is refused with QuotaExceeded;
- under its limits, a claim takes room as any other does (the tier's policy picks the
  victim). So a budget bounds what its namespaces hold; it reserves nothing for them.
  When the budgets of a tier add up to at most its capacity, no budgeted namespace is
  ever pushed out of the tier by another's writes (allocator fragmentation aside).

Reservations live in the top tier, so their bytes count against the top tier's limit
too: a tenant cannot hold more of it in half-written blocks than in stored ones.

Not thread-safe: :class:`Ledger` is the index's (kvstore/node/state.py) and runs under
its lock; a Budget is a frozen value, replaced whole when a tenant gains a namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.errors import QuotaExceeded
from kvstore.tier_kinds import TierKind

__all__ = ["Budget", "Ledger", "Usage"]


@dataclass(frozen=True, slots=True, eq=False)
class Budget:
    """Limits shared by a set of namespaces (a tenant's, as the server sees it).

    Attributes:
        name: who it is for, in error messages (the node attaches no meaning to it).
        namespaces: the namespace fingerprints it covers.
        tier_bytes: header + payload bytes its blocks may hold per tier (absent:
            unlimited there).
        reservations: writes in flight at once (0: unlimited).
        reserved_bytes: bytes of writes in flight at once (0: unlimited).
    """

    name: str
    namespaces: frozenset[bytes] = frozenset()
    tier_bytes: Mapping[TierKind, int] = field(default_factory=lambda: MappingProxyType({}))
    reservations: int = 0
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        # a private read-only copy: the caller's dict may change, the budget may not
        object.__setattr__(self, "tier_bytes", MappingProxyType(dict(self.tier_bytes)))
        object.__setattr__(self, "namespaces", frozenset(self.namespaces))

    def limit(self, tier: TierKind) -> int | None:
        """Bytes allowed in ``tier``; None when unlimited."""
        return self.tier_bytes.get(tier)


@dataclass(slots=True)
class Usage:
    """What a budget's namespaces hold now: bytes per tier, writes in flight."""

    tier_bytes: dict[TierKind, int] = field(default_factory=dict)
    reservations: int = 0
    reserved_bytes: int = 0


@dataclass(slots=True)
class _Share:
    """One namespace's blocks in one tier: their bytes and recency (oldest first)."""

    nbytes: int = 0
    order: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class Ledger:
    """Per namespace fingerprint: bytes and blocks per tier level, writes in flight;
    and the budgets that cover fingerprints. Used under the index's lock only."""

    def __init__(self, kinds: Callable[[int], TierKind]) -> None:
        self._kind = kinds  # level -> tier kind (the node's tiers grow while opening)
        self._shares: dict[tuple[bytes, int], _Share] = {}
        self._inflight: dict[bytes, list[int]] = {}  # fp -> [count, bytes]
        self._budgets: dict[str, Budget] = {}
        self._budget_of: dict[bytes, Budget] = {}

    # -- budgets ---------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Install (or replace, by name) a budget; its fingerprints leave any other."""
        old = self._budgets.get(budget.name)
        if old is not None:
            for fp in old.namespaces:
                if self._budget_of.get(fp) is old:
                    del self._budget_of[fp]
        self._budgets[budget.name] = budget
        for fp in budget.namespaces:
            self._budget_of[fp] = budget

    def budget_of(self, fp: bytes) -> Budget | None:
        """The budget covering a namespace, if any."""
        return self._budget_of.get(fp)

    def usage(self, budget: Budget, levels: int) -> Usage:
        """What ``budget``'s namespaces hold over the first ``levels`` tiers."""
        out = Usage()
        for level in range(levels):
            out.tier_bytes[self._kind(level)] = self._held(budget, level)
        for fp in budget.namespaces:
            n, b = self._inflight.get(fp, (0, 0))
            out.reservations += n
            out.reserved_bytes += b
        return out

    # -- blocks ----------------------------------------------------------------------------

    def add(self, fp: bytes, level: int, key: bytes, size: int) -> None:
        """A block entered tier ``level`` (stored, moved in, reloaded), newest."""
        share = self._shares.get((fp, level))
        if share is None:
            share = self._shares[(fp, level)] = _Share()
        share.nbytes += size
        share.order[key] = None

    def remove(self, fp: bytes, level: int, key: bytes, size: int) -> None:
        """A block left tier ``level`` (moved out, dropped, removed)."""
        share = self._shares.get((fp, level))
        if share is None or key not in share.order:
            return  # not there: nothing to take back
        del share.order[key]
        share.nbytes -= size
        if not share.order:
            del self._shares[(fp, level)]

    def touch(self, fp: bytes, level: int, key: bytes) -> None:
        """A block was read: it becomes its namespace's most recent there."""
        share = self._shares.get((fp, level))
        if share is not None and key in share.order:
            share.order.move_to_end(key)

    # -- writes in flight ------------------------------------------------------------------

    def reserve(self, fp: bytes, size: int) -> None:
        """Count a reservation of ``size`` bytes for a namespace."""
        slot = self._inflight.setdefault(fp, [0, 0])
        slot[0] += 1
        slot[1] += size

    def unreserve(self, fp: bytes, size: int) -> None:
        """A reservation ended (committed or aborted)."""
        slot = self._inflight.get(fp)
        if slot is None:
            return
        slot[0] -= 1
        slot[1] -= size
        if slot[0] <= 0:
            del self._inflight[fp]

    # -- checks ----------------------------------------------------------------------------

    def over(self, fp: bytes, level: int, size: int, *, reservation: bool) -> Budget | None:
        """Check a claim of ``size`` bytes in tier ``level`` for namespace ``fp``.

        Raises QuotaExceeded for a reservation past the budget's writes in flight.
        Returns the budget when the claim would take it past its bytes in that tier
        (the caller makes room from its own blocks, see :meth:`oldest`), else None.
        """
        budget = self._budget_of.get(fp)
        if budget is None:
            return None
        pending = 0
        if reservation:
            count, pending = self._in_flight(budget)
            if budget.reservations and count + 1 > budget.reservations:
                raise QuotaExceeded(
                    f"{budget.name}: {count} writes in flight, the quota allows "
                    f"{budget.reservations}; finish or abort one first"
                )
            if budget.reserved_bytes and pending + size > budget.reserved_bytes:
                raise QuotaExceeded(
                    f"{budget.name}: {pending} bytes of writes in flight, the quota allows "
                    f"{budget.reserved_bytes}; this write needs {size} more"
                )
        limit = budget.limit(self._kind(level))
        if limit is None:
            return None
        if size > limit:
            raise QuotaExceeded(
                f"{budget.name}: a block of {size} bytes exceeds its "
                f"{self._kind(level).value} quota of {limit}"
            )
        if level == 0 and not reservation:
            _, pending = self._in_flight(budget)  # space held for writes counts too
        return budget if self._held(budget, level) + pending + size > limit else None

    def oldest(
        self,
        budget: Budget,
        level: int,
        busy: Callable[[bytes], bool],
        age: Callable[[bytes], float],
    ) -> bytes | None:
        """The budget's least recently used block in tier ``level`` that is not
        ``busy`` (pinned or moving); None when every one is."""
        best: bytes | None = None
        best_age = 0.0
        for fp in budget.namespaces:
            share = self._shares.get((fp, level))
            if share is None:
                continue
            for key in share.order:
                if busy(key):
                    continue
                a = age(key)
                if best is None or a < best_age:
                    best, best_age = key, a
                break  # the first one not busy is this namespace's oldest
        return best

    def _held(self, budget: Budget, level: int) -> int:
        total = 0
        for fp in budget.namespaces:
            share = self._shares.get((fp, level))
            if share is not None:
                total += share.nbytes
        return total

    def _in_flight(self, budget: Budget) -> tuple[int, int]:
        count = nbytes = 0
        for fp in budget.namespaces:
            slot = self._inflight.get(fp)
            if slot is not None:
                count += slot[0]
                nbytes += slot[1]
        return count, nbytes
