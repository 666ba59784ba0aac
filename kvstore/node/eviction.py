"""Which blocks an admin eviction may take, and what it did: plain records, no I/O.

An operator evicts by tier, byte target and filters (``kvstore evict``); the node
(kvstore/node/mover.py) walks a tier in its policy's eviction order, keeps the blocks a
:class:`BlockFilter` accepts, skips (and counts) pinned ones, and reports an
:class:`EvictResult`. The filter sees only what the node knows about a block: its
stored key, its header's namespace fingerprint and when it was last used. Tenants and
models are resolved to fingerprints by the server (kvstore/server/gateway.py), which is the
only place that knows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockFilter", "EvictResult"]


@dataclass(frozen=True, slots=True)
class BlockFilter:
    """Conditions a block must all meet to be chosen; the default matches every block.

    Attributes:
        namespaces: namespace fingerprints to keep (None: any namespace, including
            blocks written without one; an empty set matches nothing).
        key_prefix: the stored key must start with these bytes.
        idle_s: the block was not stored or read for at least this many seconds.
    """

    namespaces: frozenset[bytes] | None = None
    key_prefix: bytes = b""
    idle_s: float = 0.0

    def matches(self, key: bytes, namespace_fp: bytes, used_at: float, now: float) -> bool:
        """Whether a block (key, header fingerprint, last use on the monotonic clock)
        qualifies at time ``now``."""
        if self.namespaces is not None and namespace_fp not in self.namespaces:
            return False
        if self.key_prefix and not key.startswith(self.key_prefix):
            return False
        return not (self.idle_s > 0 and now - used_at < self.idle_s)

    @property
    def empty(self) -> bool:
        """True when the filter accepts every block."""
        return self.namespaces is None and not self.key_prefix and self.idle_s <= 0


@dataclass(slots=True)
class EvictResult:
    """What an eviction moved (or, for a dry run, would move) out of one tier.

    ``demoted`` blocks went one tier down and are still on the node; ``dropped`` ones
    left it; ``nbytes`` is their header + payload bytes. ``skipped_pinned`` counts
    matching blocks passed over because a reader (or a move in flight) held them.
    ``blocks`` lists the first chosen blocks as (stored key, size), up to the caller's
    limit.
    """

    tier: str
    capacity: int
    used_before: int
    used_after: int = 0
    demoted: int = 0
    dropped: int = 0
    nbytes: int = 0
    skipped_pinned: int = 0
    dry_run: bool = False
    next_tier: str = ""
    blocks: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def moved(self) -> int:
        """Blocks that left the tier (demoted or dropped)."""
        return self.demoted + self.dropped
