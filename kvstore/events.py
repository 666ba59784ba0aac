"""Block lifecycle events, taken from a bounded queue by whoever mirrors the node.

The node appends one event per state change (under its lock, so the order is the
order of changes); the directory publisher and the scheduler take them in batches.
The queue is bounded: a consumer that falls behind sees ``dropped > 0`` and must
re-list the node instead of trusting a partial stream.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvstore.tier_kinds import TierKind

__all__ = ["BlockEvent", "BlockMoved", "BlockRemoved", "BlockStored", "EventQueue"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A block became readable on this node."""

    key: bytes
    tier: TierKind
    size: int
    namespace_fp: bytes


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block is no longer on this node (evicted, removed, or found corrupt)."""

    key: bytes
    tier: TierKind


@dataclass(frozen=True, slots=True)
class BlockMoved:
    """A block changed tier on this node (demotion or promotion)."""

    key: bytes
    src: TierKind
    dst: TierKind


BlockEvent = BlockStored | BlockRemoved | BlockMoved


class EventQueue:
    """A bounded FIFO of events with a drop counter; thread-safe."""

    def __init__(self, maxlen: int = 1 << 20) -> None:
        self._q: deque[BlockEvent] = deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self.dropped = 0
        self._taps: tuple[EventQueue, ...] = ()

    def put(self, event: BlockEvent) -> None:
        """Append one event (and to every tap); the oldest is dropped (and counted)
        when full."""
        with self._lock:
            if len(self._q) >= self._maxlen:
                self._q.popleft()
                self.dropped += 1
            self._q.append(event)
        for tap in self._taps:
            tap.put(event)

    def tap(self, maxlen: int = 1 << 16) -> EventQueue:
        """A second queue that gets a copy of every event from now on, for one more
        consumer (the KV-events publisher beside the directory publisher); it drops
        and counts on its own when its consumer falls behind."""
        q = EventQueue(maxlen)
        with self._lock:
            self._taps = (*self._taps, q)
        return q

    def untap(self, q: EventQueue) -> None:
        """Stop copying events into ``q``."""
        with self._lock:
            self._taps = tuple(t for t in self._taps if t is not q)

    def take(self, limit: int | None = None) -> list[BlockEvent]:
        """Take up to ``limit`` events (all if None), oldest first."""
        with self._lock:
            n = len(self._q) if limit is None else min(limit, len(self._q))
            return [self._q.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._q)
