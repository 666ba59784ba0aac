"""Prometheus exposition of one node: a collector over its books, and an HTTP server.

Nothing here is global. :func:`node_registry` builds a fresh ``CollectorRegistry`` per
node, holding one :class:`NodeCollector` that reads ``StoreNode.stats()`` and the
counter bags (kvstore/observe/counters.py) at scrape time; several nodes in one process therefore
never share series, and the request path never touches prometheus_client (it bumps a
dict entry in NodeCounters). Names and the counter-key contract: kvstore/observe/names.py.

Wiring for ``kvstore serve`` (prometheus-client comes with the ``metrics`` extra)::

    from kvstore.observe.prometheus import MetricsServer, node_registry
    reg = node_registry(node, counters=[gateway.books.counters], gauges=gateway.gauges)
    metrics = MetricsServer(reg, host=cfg.metrics_host, port=cfg.metrics_port).start()
    ...                                   # metrics.port is the bound port
    metrics.stop()

The endpoint has no authentication: it carries no keys, but it does name tenants, so
it binds loopback unless told otherwise.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstore.errors import ClosedError, ConfigError
from kvstore.observe.counters import LatencySnapshot, NodeCounters
from kvstore.observe.names import (
    EVENTS_DROPPED,
    LATENCY,
    NODE_INFO,
    PINNED,
    SERVER_PREFIX,
    TIER_BLOCKS,
    TIER_CAPACITY,
    TIER_USED,
    Family,
    Sample,
    fold_counters,
    merge_counters,
)

__all__ = ["MetricsServer", "NodeCollector", "StatsSource", "node_registry"]

log = logging.getLogger(__name__)


class StatsSource(Protocol):
    """What the collector reads: a StoreNode, or anything shaped like one."""

    counters: NodeCounters

    def stats(self) -> dict[str, Any]: ...


class NodeCollector(Collector):
    """Builds every ``kvstore_*`` family from a node's stats at scrape time.

    ``counters`` are extra counter bags (the gateway's) summed with the node's, key by
    key; ``gauges`` are live server values exported as ``kvstore_server_<name>``.
    Scrapes are cheap (one pass over the node's index under its lock, for block counts).
    """

    def __init__(
        self,
        node: StatsSource,
        *,
        counters: Sequence[NodeCounters] = (),
        gauges: Mapping[str, Callable[[], float]] | None = None,
    ) -> None:
        self.node = node
        self.counters = (node.counters, *counters)
        self.gauges = gauges if gauges is not None else {}

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: the series depend on the node's tiers and tenants."""
        return ()

    def collect(self) -> Iterable[Metric]:
        """One consistent-enough pass: each source is snapshotted once per scrape."""
        stats = self.node.stats()
        tiers = list(stats["tiers"])
        counters = merge_counters([stats["counters"], *(c.snapshot() for c in self.counters[1:])])
        info = InfoMetricFamily(NODE_INFO.name.removesuffix("_info"), NODE_INFO.help)
        info.add_metric([], {"node_id": str(stats["node_id"]), "tiers": ",".join(tiers)})
        yield info
        yield from _tier_gauges(stats["tiers"])
        yield _gauge(PINNED, {(): stats["pinned"]})
        dropped = CounterMetricFamily(EVENTS_DROPPED.name, EVENTS_DROPPED.help)
        dropped.add_metric([], stats["events_dropped"])
        yield dropped
        yield from _counter_families(fold_counters(counters, tiers))
        yield from _latency(self.counters)
        yield from self._server_gauges()

    def _server_gauges(self) -> Iterator[Metric]:
        for name, fn in sorted(self.gauges.items()):
            try:
                value = float(fn())
            except Exception as exc:  # a gauge must never fail the whole scrape
                log.warning("metrics: server gauge %s failed: %s", name, exc)
                continue
            g = GaugeMetricFamily(SERVER_PREFIX + name, f"Server gauge {name!r}.")
            g.add_metric([], value)
            yield g


def _gauge(f: Family, values: Mapping[tuple[str, ...], float]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(f.name, f.help, labels=f.labels)
    for labels, v in values.items():
        g.add_metric(list(labels), v)
    return g


def _tier_gauges(tiers: Mapping[str, Mapping[str, int]]) -> Iterator[Metric]:
    for f, field in ((TIER_CAPACITY, "capacity"), (TIER_USED, "used"), (TIER_BLOCKS, "blocks")):
        yield _gauge(f, {(t,): v[field] for t, v in tiers.items()})


def _counter_families(samples: Mapping[Sample, int]) -> Iterator[Metric]:
    by_family: dict[Family, list[tuple[tuple[str, ...], int]]] = {}
    for (f, labels), v in samples.items():
        by_family.setdefault(f, []).append((labels, v))
    for f in sorted(by_family, key=lambda f: f.name):
        m = CounterMetricFamily(f.name, f.help, labels=f.labels)
        for labels, v in sorted(by_family[f]):
            m.add_metric(list(labels), v)
        yield m


def _latency(bags: Iterable[NodeCounters]) -> Iterator[Metric]:
    merged: dict[tuple[str, str], LatencySnapshot] = {}
    bounds: tuple[float, ...] = ()
    for bag in bags:
        bounds = bag.latency.bounds
        for key, snap in bag.latency.snapshot().items():
            old = merged.get(key)
            if old is not None:
                counts = tuple(a + b for a, b in zip(old.counts, snap.counts, strict=True))
                snap = LatencySnapshot(counts, old.sum + snap.sum, old.count + snap.count)
            merged[key] = snap
    if not merged:
        return
    h = HistogramMetricFamily(LATENCY.name, LATENCY.help, labels=LATENCY.labels)
    for (op, path), snap in sorted(merged.items()):
        cumulative, buckets = 0, []
        for bound, n in zip((*bounds, float("inf")), snap.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        h.add_metric([op, path], buckets, snap.sum)
    yield h


def node_registry(
    node: StatsSource,
    *,
    counters: Sequence[NodeCounters] = (),
    gauges: Mapping[str, Callable[[], float]] | None = None,
) -> CollectorRegistry:
    """A fresh registry holding one :class:`NodeCollector` for ``node`` (never the
    process-global default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, counters=counters, gauges=gauges))
    return registry


class MetricsServer:
    """Serves one registry on ``http://host:port/metrics`` from a daemon thread.

    States: unopened -> open (:meth:`start`) -> closed (:meth:`stop`, idempotent);
    starting again after stop is a ClosedError. ``port=0`` picks a free port, reported
    by :attr:`port` once started. A context manager starts and stops it.
    """

    def __init__(
        self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics_port: {port} is not a TCP port (0-65535)")
        self.registry = registry
        self.host = host
        self._want_port = port
        self._port = 0
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port (0 before :meth:`start`)."""
        return self._port

    @property
    def url(self) -> str:
        """Where to scrape, e.g. ``http://127.0.0.1:9400/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}/metrics"

    def start(self) -> MetricsServer:
        """Bind and serve; a port in use is a ConfigError naming it. Returns self."""
        with self._lock:
            if self._closed:
                raise ClosedError("metrics server is stopped; build a new one")
            if self._httpd is not None:
                return self
            try:
                httpd = _bind(self.host, self._want_port, self.registry)
            except OSError as exc:
                raise ConfigError(
                    f"metrics_port: cannot listen on {self.host}:{self._want_port} "
                    f"({exc.strerror or exc})"
                ) from None
            self._port = httpd.server_port
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.05},  # stop() returns within 50 ms
                name=f"kvstore-metrics-{self._port}",
                daemon=True,
            )
            self._httpd = httpd
            self._thread.start()
        log.info("metrics on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        with self._lock:
            self._closed = True
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _bind(host: str, port: int, registry: CollectorRegistry) -> Any:
    """A threading WSGI server for the registry, bound to host (IPv4 or IPv6) and port."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    return make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
