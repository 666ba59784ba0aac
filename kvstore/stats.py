"""Node counters: a small thread-safe bag of monotonically increasing integers.

Injected into the node (never global) so tests and several in-process nodes keep
separate books; the metrics exporter reads :meth:`snapshot`.
"""

from __future__ import annotations

import threading

__all__ = ["NodeCounters"]


class NodeCounters:
    """Named counters (``hits_dram``, ``misses``, ``bytes_in`` ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, int] = {}

    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a counter, creating it at zero."""
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def get(self, name: str) -> int:
        """Current value (0 if never incremented)."""
        return self._c.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._c)
