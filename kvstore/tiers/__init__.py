"""Storage tiers: HBM and DRAM slabs (memory.py) and the lmdb-indexed SSD tier (disk.py)."""

from kvstore.tiers.base import Tier, TierKind

__all__ = ["Tier", "TierKind"]
