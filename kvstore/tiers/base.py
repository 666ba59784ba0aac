"""The tier seam: what the node needs from any place that holds block bytes.

A tier only stores and returns bytes and accounts for its space. It does not decide
what to evict (policy.py), who may read (the node's pins) or where a block lives in
the cluster (the directory). Sizes are in bytes of header plus payload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

__all__ = ["Tier", "TierKind"]


class TierKind(str, Enum):
    """Where bytes live, fastest first. The order is the nearest-replica order."""

    HBM = "hbm"
    DRAM = "dram"
    SSD = "ssd"

    @property
    def rank(self) -> int:
        """0 for the fastest tier; used to prefer replicas."""
        return _RANK[self]


_RANK = {TierKind.HBM: 0, TierKind.DRAM: 1, TierKind.SSD: 2}


class Tier(ABC):
    """Space accounting common to every tier."""

    kind: TierKind

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold in all."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes currently allocated (including allocator rounding)."""

    def fits_ever(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` could fit if the tier were empty."""
        return nbytes <= self.capacity

    @abstractmethod
    def close(self) -> None:
        """Release the tier's resources; idempotent."""
