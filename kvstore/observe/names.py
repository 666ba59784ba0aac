"""The metric naming scheme, and how counter keys map onto it. Pure Python.

Kept apart from kvstore/observe/prometheus.py (the prometheus_client exporter) so that
``kvstore stats`` and tests can fold counters the same way without the exporter, and
so the whole contract between whoever counts and whoever exports is on one page.

Counter-key contract (keys of :class:`kvstore.observe.counters.NodeCounters`; ``<tier>`` is
``hbm``/``dram``/``ssd``, ``<path>`` one of ``inproc``/``shm``/``tcp``/``ucx``):

=========================== ====================================================== =====
key                         exported as                                            by
=========================== ====================================================== =====
``hits_<tier>``             ``kvstore_hits_total{tier}``                           node
``misses``                  ``kvstore_misses_total`` (a namespace mismatch too)    node
(derived)                   ``kvstore_lookups_total`` = sum of hits + misses       -
``puts``                    ``kvstore_puts_total`` (committed new blocks)          node
``bytes_in``                ``kvstore_put_bytes_total`` (their payload, any path)  node
``bytes_out``               ``kvstore_transfer_bytes_total{out, inproc}``          node
``bytes_<in|out>_<path>``   ``kvstore_transfer_bytes_total{direction, path}``      svc
``demotions_<tier>``        ``kvstore_demotions_total{tier}`` (source tier)        node
``bytes_demoted_<tier>``    ``kvstore_demoted_bytes_total{tier}``                  node
``promotions[_<tier>]``     ``kvstore_promotions_total{tier}`` (source; bare: ssd) node
``bytes_promoted[_<tier>]`` ``kvstore_promoted_bytes_total{tier}``                 node
``evictions_<tier>``        ``kvstore_evictions_total{tier}`` (left the node)      node
``corrupt_blocks``          ``kvstore_corrupt_blocks_total{source="ssd"}``         node
``corrupt_blocks_<tier>``   ``kvstore_corrupt_blocks_total{source=<tier>}`` (hbm)  node
``corrupt_transfer[s]``     ``kvstore_corrupt_blocks_total{source="transfer"}``    both
``namespace_mismatch``      ``kvstore_namespace_mismatches_total``                 node
``lost_blocks``             ``kvstore_lost_blocks_total``                          node
anything else               ``kvstore_counter_total{counter="<key>"}``             any
=========================== ====================================================== =====

Who counts what. The node counts everything marked "node" (kvstore/node/: index.py,
claims.py, moves.py, state.py, mover.py, writes.py, store.py). The service (gateway,
data server, maintenance) counts, in its own bag (``Gateway.counters``, summed with the
node's at scrape time):

- ``bytes_out_<path>``: payload bytes handed to a reader, once the read succeeded;
- ``bytes_in_<path>``: payload bytes of a put that committed (``commit`` returned True);
- per tenant, the same events with ``tenant=p.tenant``: ``hits_<tier>`` (from
  ``BlockRead.tier``), ``misses`` (namespace mismatches included), ``puts``, ``bytes_in``
  and ``bytes_<in|out>_<path>``: the node never sees tenants, only scoped keys;
- latency: one ``counters.observe(op, path, seconds)`` (or ``with counters.time(...)``)
  per get/put request, ``op`` in get/put, ``path`` in shm/tcp/ucx.

As implemented (kvstore/server/books.py, session.py; the gRPC control plane carries no
payloads): ``tcp`` is a payload carried on the data socket (over TCP or the same-host
Unix socket alike), ``ucx`` the same on a connection moved to UCX, ``shm`` an extent
handed over under a lease (LEASE reads, RESERVE + COMMIT writes); a LEASE reply's blocks
that are not in DRAM travel inline and count as ``tcp``. Per-tenant hits count the tier
the read found the block in (``BlockRead.hit``: an SSD hit is ``ssd`` even when
promoted); per-tenant misses include namespace mismatches and unreadable SSD records, so
a tenant's hits + misses are its lookups.
Latency: data-socket GET/PUT are (get|put, tcp), LEASE is (get, shm), COMMIT is (put,
shm) (RESERVE is not timed); an observation includes sending the reply. Reads a
same-host client serves itself from the published DRAM index (kvstore/shm/index.py)
reach the server afterwards in TOUCH frames and count as ``shm`` too: ``hits_dram``
(node and tenant), ``bytes_out_shm`` and one (get, shm) observation, timed by the
client, per call served wholly that way. A DRAM block the index had no room for counts
``shm_index_full`` (its reads take leases).
Each time a connection polls for its client's next request after a reply
(kvstore/wire/polling.py) counts ``data_polls_caught`` or ``data_polls_missed``.
Quotas (kvstore/server/quotas.py): the service counts ``quota_refusals`` (a put refused
with QuotaExceeded) and ``puts_stalled`` (a put whose payload missed its deadline, cut),
both also per tenant; the node counts ``quota_evictions_<tier>`` (a block leaving a tier
to make room within its own namespace's budget) and ``quota_drops`` (a demotion dropped
because the budget has no room below). All export as ``kvstore_counter_total``; a
tenant's usage is in ``stats()`` as ``quota_used_<tier>@<tenant>``,
``quota_inflight@<tenant>`` and ``quota_inflight_bytes@<tenant>``.
Admin moves count ``exported_blocks``, ``imported_blocks`` and ``purged_blocks``
(``kvstore_counter_total``); an export reads through the node, so it also counts as a
node hit.

The node's bare ``bytes_out`` is its in-process get/get_into, i.e. the ``inproc``
series; nothing should also count ``bytes_out_inproc`` for those bytes. In-process puts
would be ``bytes_in_inproc`` (StoreNode.put does not count it yet).

A tenant-tagged key (``hits_dram@acme``, kvstore/observe/counters.py) is exported in the twin
family ``kvstore_tenant_<rest>`` with an extra ``tenant`` label (``kvstore_tenant_hits_total
{tier, tenant}``), never in the untagged family, so ``sum()`` never double counts; and
it never adds to the untagged total (count both when both are wanted).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvstore.observe.counters import PATHS, split_key

__all__ = [
    "COUNTER_FAMILIES",
    "FAMILIES",
    "Family",
    "SERVER_PREFIX",
    "Sample",
    "classify",
    "fold_counters",
    "merge_counters",
    "tenant_family",
]


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric: its full name (counters end in ``_total``), type and labels."""

    name: str
    kind: str  # counter | gauge | histogram | info
    help: str
    labels: tuple[str, ...] = ()


_C = "counter"
HITS = Family("kvstore_hits_total", _C, "Lookups that found the block, by its tier.", ("tier",))
MISSES = Family("kvstore_misses_total", _C, "Lookups that found no usable block.")
LOOKUPS = Family("kvstore_lookups_total", _C, "Lookups (hits + misses): the hit-rate denominator.")
PUTS = Family("kvstore_puts_total", _C, "Puts that committed a new block.")
PUT_BYTES = Family("kvstore_put_bytes_total", _C, "Payload bytes of committed puts, any path.")
TRANSFER = Family(
    "kvstore_transfer_bytes_total",
    _C,
    "Payload bytes moved to (out) or from (in) clients, by transport path.",
    ("direction", "path"),
)
DEMOTIONS = Family("kvstore_demotions_total", _C, "Blocks demoted out of a tier.", ("tier",))
DEMOTED_BYTES = Family("kvstore_demoted_bytes_total", _C, "Bytes demoted out of a tier.", ("tier",))
PROMOTIONS = Family(
    "kvstore_promotions_total", _C, "Blocks promoted out of a tier on a hit.", ("tier",)
)
PROMOTED_BYTES = Family(
    "kvstore_promoted_bytes_total", _C, "Bytes promoted out of a tier.", ("tier",)
)
EVICTIONS = Family(
    "kvstore_evictions_total", _C, "Blocks that left the node from a tier.", ("tier",)
)
CORRUPT = Family(
    "kvstore_corrupt_blocks_total",
    _C,
    "Checksum failures (served as misses), by where they were caught.",
    ("source",),
)
NS_MISMATCH = Family(
    "kvstore_namespace_mismatches_total", _C, "Lookups refused for a namespace mismatch."
)
LOST = Family("kvstore_lost_blocks_total", _C, "Indexed blocks whose bytes were gone.")
OTHER = Family(
    "kvstore_counter_total", _C, "Node/server counters without a family of their own.", ("counter",)
)
COUNTER_FAMILIES = (
    HITS,
    MISSES,
    LOOKUPS,
    PUTS,
    PUT_BYTES,
    TRANSFER,
    DEMOTIONS,
    DEMOTED_BYTES,
    PROMOTIONS,
    PROMOTED_BYTES,
    EVICTIONS,
    CORRUPT,
    NS_MISMATCH,
    LOST,
    OTHER,
)

NODE_INFO = Family(
    "kvstore_node_info", "info", "The node behind this endpoint.", ("node_id", "tiers")
)
TIER_CAPACITY = Family("kvstore_tier_capacity_bytes", "gauge", "Tier capacity.", ("tier",))
TIER_USED = Family("kvstore_tier_used_bytes", "gauge", "Tier bytes in use.", ("tier",))
TIER_BLOCKS = Family("kvstore_tier_blocks", "gauge", "Blocks stored in a tier.", ("tier",))
PINNED = Family("kvstore_pinned_blocks", "gauge", "Blocks pinned by readers right now.")
EVENTS_DROPPED = Family(
    "kvstore_events_dropped_total", _C, "Block events dropped by a full event queue."
)
LATENCY = Family(
    "kvstore_request_duration_seconds",
    "histogram",
    "Server-side request latency, one observation per request.",
    ("op", "path"),
)
SERVER_PREFIX = "kvstore_server_"  # + a server gauge's name (connections, leases): gauges
FAMILIES = (
    *COUNTER_FAMILIES,
    NODE_INFO,
    TIER_CAPACITY,
    TIER_USED,
    TIER_BLOCKS,
    PINNED,
    EVENTS_DROPPED,
    LATENCY,
)

_T = "[a-z0-9]+"
_RULES: list[tuple[re.Pattern[str], Family, Callable[[re.Match[str]], tuple[str, ...]]]] = [
    (re.compile(rf"hits_({_T})"), HITS, lambda m: (m[1],)),
    (re.compile("misses"), MISSES, lambda m: ()),
    (re.compile("puts"), PUTS, lambda m: ()),
    (re.compile("bytes_in"), PUT_BYTES, lambda m: ()),
    (re.compile("bytes_out"), TRANSFER, lambda m: ("out", "inproc")),
    (re.compile(rf"bytes_(in|out)_({_T})"), TRANSFER, lambda m: (m[1], m[2])),
    (re.compile(rf"demotions_({_T})"), DEMOTIONS, lambda m: (m[1],)),
    (re.compile(rf"bytes_demoted_({_T})"), DEMOTED_BYTES, lambda m: (m[1],)),
    (re.compile(rf"promotions(?:_({_T}))?"), PROMOTIONS, lambda m: (m[1] or "ssd",)),
    (re.compile(rf"bytes_promoted(?:_({_T}))?"), PROMOTED_BYTES, lambda m: (m[1] or "ssd",)),
    (re.compile(rf"evictions_({_T})"), EVICTIONS, lambda m: (m[1],)),
    (re.compile("corrupt_blocks"), CORRUPT, lambda m: ("ssd",)),
    (re.compile(rf"corrupt_blocks_({_T})"), CORRUPT, lambda m: (m[1],)),
    (re.compile("corrupt_transfers?"), CORRUPT, lambda m: ("transfer",)),
    (re.compile("namespace_mismatch"), NS_MISMATCH, lambda m: ()),
    (re.compile("lost_blocks"), LOST, lambda m: ()),
]

Sample = tuple[Family, tuple[str, ...]]  # a family and its label values


def classify(name: str) -> Sample:
    """The family and label values of an untagged counter key."""
    for pattern, family, labels in _RULES:
        m = pattern.fullmatch(name)
        if m:
            return family, labels(m)
    return OTHER, (name,)


_TWINS: dict[str, Family] = {}


def tenant_family(f: Family) -> Family:
    """The per-tenant twin of a counter family: ``kvstore_tenant_...`` plus ``tenant``."""
    twin = _TWINS.get(f.name)
    if twin is None:
        name = "kvstore_tenant_" + f.name.removeprefix("kvstore_")
        twin = _TWINS[f.name] = Family(name, f.kind, f.help + " Per tenant.", (*f.labels, "tenant"))
    return twin


def merge_counters(snapshots: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Sum several counter snapshots key by key (node counters + server counters)."""
    out: dict[str, int] = {}
    for snap in snapshots:
        for k, v in snap.items():
            out[k] = out.get(k, 0) + v
    return out


def fold_counters(counters: Mapping[str, int], tiers: Iterable[str] = ()) -> dict[Sample, int]:
    """Counter keys folded into (family, label values) -> value, lookups derived.

    Series every dashboard needs are present at 0 from the start (hits and evictions
    per tier in ``tiers``, bytes per path and direction, misses, puts, corruption), so
    a rate() has a series before the first event.
    """
    out: dict[Sample, int] = {}
    tiers = tuple(tiers)
    for f, labels in _seed(tiers):
        out[(f, labels)] = 0
    lookups: dict[str | None, int] = {None: 0}
    for key, value in counters.items():
        name, tenant = split_key(key)
        f, labels = classify(name)
        if tenant is not None:
            f, labels = tenant_family(f), (*labels, tenant)
        out[(f, labels)] = out.get((f, labels), 0) + value
        if f.name.endswith(("_hits_total", "_misses_total")):
            lookups[tenant] = lookups.get(tenant, 0) + value
    for tenant, n in lookups.items():
        sample = (LOOKUPS, ()) if tenant is None else (tenant_family(LOOKUPS), (tenant,))
        out[sample] = n
    return out


def _seed(tiers: tuple[str, ...]) -> Iterable[Sample]:
    yield from ((f, ()) for f in (MISSES, PUTS, PUT_BYTES, NS_MISMATCH, LOST))
    yield from ((CORRUPT, (s,)) for s in ("ssd", "transfer"))
    yield from ((TRANSFER, (d, p)) for d in ("in", "out") for p in PATHS)
    for i, t in enumerate(tiers):
        yield HITS, (t,)
        yield EVICTIONS, (t,)
        if i + 1 < len(tiers):
            yield DEMOTIONS, (t,)
            yield DEMOTED_BYTES, (t,)
        if t == "ssd":
            yield PROMOTIONS, (t,)
            yield PROMOTED_BYTES, (t,)
