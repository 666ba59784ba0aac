"""Node counters and latency histograms: the books a node (and its server) keep.

Injected into the node (never global) so tests and several in-process nodes keep
separate books; the metrics exporter (kvstore/observe/prometheus.py) and ``kvstore stats`` only
read :meth:`NodeCounters.snapshot` and :meth:`Latency.snapshot`. Nothing here imports
prometheus_client: the hot path pays a dict update, not an exporter.

Counter keys are flat strings so they travel unchanged through ``StatsResponse`` (a
``map<string, int64>``). A per-tenant count is the same name with ``@<tenant>``
appended (``hits_dram@acme``); tenant names never contain ``@`` (kvstore/server/auth.py).
A per-tenant key does not add to the untagged total: whoever counts per tenant counts
the total separately (the node counts totals; the gateway knows tenants).
The key contract, name by name, is in kvstore/observe/names.py.
"""

from __future__ import annotations

import re
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

__all__ = [
    "LATENCY_BUCKETS",
    "PATHS",
    "TENANT_SEP",
    "Latency",
    "LatencySnapshot",
    "NodeCounters",
    "counter_key",
    "split_key",
]

TENANT_SEP = "@"
PATHS = ("inproc", "shm", "tcp", "ucx")
"""Transport paths a request can take: in process, shared memory, data socket."""

LATENCY_BUCKETS: tuple[float, ...] = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
)
"""Upper bounds in seconds, 10 us .. 1 s: a DRAM hit over shm is tens of us, an SSD
read of a 16 MiB block over TCP tens of ms; anything slower lands in +Inf."""

_LABEL = re.compile(r"[a-z][a-z0-9_]{0,31}")


def counter_key(name: str, tenant: str | None = None) -> str:
    """The flat key of a counter, tagged with a tenant when given."""
    return name if tenant is None else f"{name}{TENANT_SEP}{tenant}"


def split_key(key: str) -> tuple[str, str | None]:
    """``"hits_dram@acme"`` -> ``("hits_dram", "acme")``; untagged keys give None."""
    name, sep, tenant = key.partition(TENANT_SEP)
    return (name, tenant) if sep else (name, None)


class NodeCounters:
    """Named monotonically increasing integers (``hits_dram``, ``misses`` ...) plus the
    request latency histograms (:attr:`latency`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, int] = {}
        self.latency = Latency()

    def inc(self, name: str, n: int = 1, *, tenant: str | None = None) -> None:
        """Add ``n`` to a counter (``name@tenant`` when a tenant is given), creating it at 0."""
        key = name if tenant is None else f"{name}{TENANT_SEP}{tenant}"
        with self._lock:
            self._c[key] = self._c.get(key, 0) + n

    def get(self, name: str, *, tenant: str | None = None) -> int:
        """Current value (0 if never incremented)."""
        return self._c.get(counter_key(name, tenant), 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter, tenant-tagged keys included."""
        with self._lock:
            return dict(self._c)

    def observe(self, op: str, path: str, seconds: float) -> None:
        """Record one request's latency (shorthand for ``latency.observe``)."""
        self.latency.observe(op, path, seconds)

    def time(self, op: str, path: str) -> AbstractContextManager[None]:
        """``with counters.time("get", "shm"): ...`` records the body's duration."""
        return self.latency.time(op, path)


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """One histogram: per-bucket (not cumulative) counts, the last one for +Inf."""

    counts: tuple[int, ...]
    sum: float
    count: int


class Latency:
    """Fixed-bucket latency histograms keyed by (op, path).

    One observation per request as the server handled it (a batch is one request).
    ``op`` is ``get`` or ``put`` for the data plane (others such as ``exists`` may be
    added); ``path`` is one of :data:`PATHS`. Both are lower_snake labels, checked on
    first use so a typo fails in tests instead of creating a stray series.
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("latency bounds must be strictly increasing")
        self.bounds = bounds
        self._lock = threading.Lock()
        self._h: dict[tuple[str, str], list[float]] = {}  # counts..., +Inf, sum

    def observe(self, op: str, path: str, seconds: float) -> None:
        """Count one request of ``seconds`` (le semantics: 10 us lands in the 10 us bucket)."""
        i = bisect_left(self.bounds, seconds)
        with self._lock:
            h = self._h.get((op, path))
            if h is None:
                h = self._new(op, path)
            h[i] += 1
            h[-1] += seconds

    def _new(self, op: str, path: str) -> list[float]:
        for what, v in (("op", op), ("path", path)):
            if not _LABEL.fullmatch(v):
                raise ValueError(f"latency {what} {v!r}: use lower_snake, e.g. 'get' / 'shm'")
        h = self._h[(op, path)] = [0.0] * (len(self.bounds) + 2)
        return h

    @contextmanager
    def time(self, op: str, path: str) -> Iterator[None]:
        """Time the ``with`` body (also when it raises: failed requests took time too)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(op, path, time.perf_counter() - t0)

    def snapshot(self) -> dict[tuple[str, str], LatencySnapshot]:
        """A consistent copy of every histogram."""
        with self._lock:
            items = [(k, list(h)) for k, h in self._h.items()]
        out = {}
        for k, h in items:
            counts = tuple(int(c) for c in h[:-1])
            out[k] = LatencySnapshot(counts, h[-1], sum(counts))
        return out
