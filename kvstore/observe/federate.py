"""One ``/metrics`` for a node served by several shard processes.

Each shard (kvstore/server/shards.py) serves its own registry on a private port; the
supervisor serves this one on the port the user asked for. A scrape reads every shard's
page and re-labels each series with ``shard="<i>"``: a dashboard sums over ``shard``
for the node and keeps the label for each shard, and a scrape config needs one target
per host, as before shards. A shard that does not answer (restarting) is left out of
that scrape and counted in ``kvstore_shard_scrape_failures_total``.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from kvstore.observe.prometheus import MetricsServer

__all__ = ["FederatedMetrics", "ShardCollector"]

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0


class ShardCollector:
    """A prometheus_client collector that reads the shards' pages at each collect."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.failures = [0] * len(self.urls)

    def collect(self) -> Iterator[Metric]:
        """Every shard's families, merged by name, each sample labelled by shard."""
        merged: dict[str, Metric] = {}
        for index, url in enumerate(self.urls):
            try:
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
                    text = resp.read().decode()
            except OSError as exc:
                self.failures[index] += 1
                log.debug("shard %d metrics unavailable: %s", index, exc)
                continue
            for fam in text_string_to_metric_families(text):
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = Metric(
                        fam.name, fam.documentation, fam.type, fam.unit
                    )
                for s in fam.samples:
                    into.add_sample(s.name, {**s.labels, "shard": str(index)}, s.value, s.timestamp)
        yield from merged.values()
        shards = GaugeMetricFamily("kvstore_shards", "Processes serving this node")
        shards.add_metric([], len(self.urls))
        yield shards
        fails = CounterMetricFamily(
            "kvstore_shard_scrape_failures",
            "Scrapes of a shard that got no answer",
            labels=["shard"],
        )
        for index, n in enumerate(self.failures):
            fails.add_metric([str(index)], n)
        yield fails


class FederatedMetrics(MetricsServer):
    """A MetricsServer whose registry is the shards' pages (see the module docstring)."""

    def __init__(self, urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 0) -> None:
        registry = CollectorRegistry(auto_describe=False)
        self.collector = ShardCollector(urls)
        registry.register(self.collector)
        super().__init__(registry, host=host, port=port)
