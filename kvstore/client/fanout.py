"""Calls on several cluster nodes at once, and how a call's deadline is shared.

A cluster client asks several nodes in one call: the nodes holding a read's keys, the
shards of a sharded node a write is split over. :class:`FanOut` runs one call per node
on a thread pool (none for a single node: the common unsharded write pays nothing) and
hands back every result or error, all calls finished, so the caller can undo what some
started when another failed. :func:`share` splits the time left among the attempts a
call may still make, so a hung node costs its share, not the whole deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.client.members import NODE_FAILURES
from kvstore.errors import TimeoutError_

__all__ = ["FanOut", "Item", "raise_other", "share"]

Item = tuple[str, list[int]]  # a node id and the positions of the call's keys it gets


class FanOut:
    """A lazily started thread pool of ``size`` threads. Thread-safe: ``_lock`` guards
    ``_pool`` (no I/O under it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The pool, started on first use."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix="kvstore-cluster")
            return self._pool

    def each(
        self, items: dict[str, list[int]], fn: Callable[[Item], Any]
    ) -> list[tuple[Item, Any]]:
        """``fn`` of each (node, positions) item, in parallel when there are several,
        each paired with its result or the exception it raised."""

        def one(item: Item) -> Any:
            try:
                return fn(item)
            except Exception as exc:
                return exc

        pairs = list(items.items())
        outs = [one(it) for it in pairs] if len(pairs) <= 1 else self.pool.map(one, pairs)
        return list(zip(pairs, outs, strict=True))

    def close(self) -> None:
        """Stop taking work (calls running finish on their own)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def raise_other(done: Sequence[tuple[Item, Any]]) -> None:
    """Raise the first error of :meth:`FanOut.each`'s results that is not a node's
    failure (those move the keys to another node; the rest are the call's)."""
    for _, out in done:
        if isinstance(out, Exception) and not isinstance(out, NODE_FAILURES):
            raise out


def share(deadline: float, tries: int) -> float:
    """One attempt's time: what is left until ``deadline`` split evenly among the
    ``tries`` attempts still possible (this one included); TimeoutError_ once past it."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError_("deadline passed before the call")
    return left / max(tries, 1)
