"""The tier seam: what the node needs from any place that holds block bytes.

A tier only stores and returns bytes and accounts for its space. It does not decide
what to evict (policy.py), who may read (the node's pins) or where a block lives in
the cluster (the directory). Sizes are in bytes of header plus payload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvstore.tiering import TierKind

__all__ = ["Tier", "TierKind"]  # TierKind re-exported: tiers are named by it


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
