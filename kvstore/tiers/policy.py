"""Eviction policies, chosen by name: a policy orders victims and touches nothing else.

A policy never frees bytes, never talks to a tier and never knows about pins: the
node (or the trace simulator) asks it for the next victim, passing a ``skip``
predicate for blocks that may not go now (pinned, in flight), and then frees the
victim itself. Sizes are in whatever unit the caller's capacity uses (bytes in the
node, blocks in the simulator).

Policies are not thread-safe: the node calls them under its own lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar

from kvstore.errors import ConfigError

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "FIFOPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
]

Key = Hashable
Skip = Callable[[Key], bool]


def _never(_: Key) -> bool:
    return False


class EvictionPolicy(ABC):
    """Orders the blocks of one tier for eviction."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, size: int) -> None:
        """A block was admitted to the tier."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A block was read (a hit). Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A block left the tier for a reason other than :meth:`pop_victim`."""

    @abstractmethod
    def pop_victim(self, skip: Skip = _never) -> Key | None:
        """Choose, forget and return the next block to evict; None if every block is skipped."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Key]:
        """Blocks in eviction order, first victim first (for dry runs and tests)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[Key, int] = OrderedDict()

    def insert(self, key: Key, size: int) -> None:
        self._od[key] = size
        self._od.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._od.pop(key, None)

    def pop_victim(self, skip: Skip = _never) -> Key | None:
        for key in self._od:
            if not skip(key):
                break
        else:
            return None
        del self._od[key]
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._od))


class FIFOPolicy(LRUPolicy):
    """Oldest insertion first; hits do not reorder (a baseline)."""

    name = "fifo"

    def touch(self, key: Key) -> None:
        return None


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): scan-resistant with FIFO queues only.

    New blocks enter a small queue (10% of capacity). Blocks read again while there
    move to the main queue; the rest leave early and are remembered in a ghost queue,
    so a block that comes back soon after goes straight to main. Main is a FIFO with
    a 2-bit frequency: a block read since its last pass gets another lap. A one-off
    scan (a long unique prompt) thus flushes only the small queue, never the hot set.
    """

    name = "s3fifo"
    SMALL_RATIO = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> size; end = newest
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_size = 0

    def insert(self, key: Key, size: int) -> None:
        self.remove(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_size += size
        self._freq[key] = 0

    def touch(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self.MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        if key in self._small:
            self._small_size -= self._small.pop(key)
        else:
            self._main.pop(key, None)
        self._freq.pop(key, None)

    def _remember(self, key: Key) -> None:
        self._ghost[key] = None
        limit = max(len(self._main), 1)
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def _evict_small(self, skip: Skip) -> Key | None:
        for _ in range(len(self._small)):
            key, size = self._small.popitem(last=False)
            self._small_size -= size
            if self._freq[key] > 0:
                self._main[key] = size  # read again while small: promote
                self._freq[key] = 0
            elif skip(key):
                self._small[key] = size  # pinned: back to the head, try the next
                self._small_size += size
            else:
                del self._freq[key]
                self._remember(key)
                return key
        return None

    def _evict_main(self, skip: Skip) -> Key | None:
        for _ in range(len(self._main) * (self.MAX_FREQ + 1)):
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = size
            elif skip(key):
                self._main[key] = size
            else:
                del self._freq[key]
                return key
        return None

    def pop_victim(self, skip: Skip = _never) -> Key | None:
        if self._small and (self._small_size >= self.SMALL_RATIO * self.capacity or not self._main):
            order = (self._evict_small, self._evict_main)
        else:
            order = (self._evict_main, self._evict_small)
        for step in order:
            key = step(skip)
            if key is not None:
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._small) + list(self._main))


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy)
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a policy by its registered name (``lru``, ``fifo``, ``s3fifo``)."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(capacity)
