"""The names of the tiers, fastest first: a contract every layer shares (events, the
directory, the scheduler), apart from the tiers' code itself (kvstore/tiers/)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["TierKind"]


class TierKind(StrEnum):
    """Where bytes live, fastest first. The order is the nearest-replica order."""

    HBM = "hbm"
    DRAM = "dram"
    SSD = "ssd"

    @property
    def rank(self) -> int:
        """0 for the fastest tier; used to prefer replicas."""
        return _RANK[self]


_RANK = {TierKind.HBM: 0, TierKind.DRAM: 1, TierKind.SSD: 2}
