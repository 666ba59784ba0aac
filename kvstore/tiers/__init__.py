"""Storage tiers: HBM and DRAM slabs (memory.py) and the lmdb-indexed SSD tier (disk.py)."""

from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import Tier

__all__ = ["Tier", "TierKind"]
