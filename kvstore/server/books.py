"""The gateway's books: whose namespaces exist, which quotas bind them, what was counted.

Every request the gateway serves is scoped and counted here before or after the node
sees it (kvstore/server/gateway.py):

- a request's namespace is built from its model and layout plus the caller's tenant
  (``Principal``), never a tenant named by the request, and recorded by fingerprint
  (kvstore/server/namespaces.py) so admin filters by tenant or model find its blocks;
- a tenant with a quota (kvstore/server/quotas.py) has it applied by the node as a
  Budget over its namespaces' fingerprints, kept here in step as it names new ones; its
  writes must name a scope (a block without a namespace could not be counted);
- while draining, writes are refused and reads keep working;
- the service's half of the counter contract (kvstore/observe/names.py): bytes per
  transport path, per-tenant hits, misses and puts. The node never sees a tenant, so
  nothing below this layer can count them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.config import ServerConfig
from kvstore.errors import (
    ConfigError,
    InvalidValue,
    KVStoreError,
    LimitExceeded,
    QuotaExceeded,
    Unavailable,
)
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.node.budgets import Budget
from kvstore.node.store import BlockRead, StoreNode
from kvstore.observe.counters import NodeCounters
from kvstore.server.namespaces import NamespaceRegistry
from kvstore.server.quotas import Quotas
from kvstore.tenants import Principal

__all__ = ["Books"]

_NS_CACHE = 4096  # namespaces kept built; past this the cache starts over


class _FixedNamespace(Namespace):
    """A Namespace whose layout and fingerprint are computed once.

    The node asks for ``fingerprint()`` on every key it reads (about 9 us each); the
    books build one of these per (tenant, model, layout) and reuse it.
    """

    __slots__ = ("_fp", "_kl")
    _fp: bytes
    _kl: KVLayout

    def __init__(self, model: str, layout: str, tenant: str) -> None:
        super().__init__(model, layout, tenant)
        object.__setattr__(self, "_kl", KVLayout.parse(layout))
        object.__setattr__(self, "_fp", Namespace.fingerprint(self))

    @property
    def kv_layout(self) -> KVLayout:
        return self._kl

    def fingerprint(self, block_tokens: int | None = None) -> bytes:
        if block_tokens is None:
            return self._fp
        return Namespace.fingerprint(self, block_tokens)


class Books:
    """Namespaces, quotas, the drain flag and the service's counters of one node."""

    def __init__(
        self, node: StoreNode, config: ServerConfig, names: NamespaceRegistry, quotas: Quotas
    ) -> None:
        self.node = node
        self.config = config
        self.counters = NodeCounters()
        self.draining = False
        self.names = names
        self.quotas = quotas
        self._ns: dict[tuple[str, str, str], Namespace] = {}
        self._ns_lock = threading.Lock()
        self._budgets: dict[str, Budget] = {}  # tenant -> the Budget the node applies
        self._budget_lock = threading.Lock()
        for q in self.quotas:  # namespaces known from earlier runs count at once
            self._budgets[q.tenant] = q.budget(self.names.select(q.tenant))
            self.node.set_budget(self._budgets[q.tenant])

    # -- admission ---------------------------------------------------------------------

    def check_batch(self, n: int) -> None:
        """Refuse a request naming more keys than ``max_batch``."""
        if n > self.config.max_batch:
            raise LimitExceeded(f"{n} keys in one request; max_batch is {self.config.max_batch}")

    def check_writer(self, p: Principal, ns: Namespace | None) -> None:
        """Refuse a write this node does not take now, or one a quota could not count."""
        if self.draining:
            raise Unavailable("server is draining: writes are refused, reads still work")
        if ns is None and p.tenant in self._budgets:
            raise InvalidValue(
                f"tenant {p.tenant!r} has a quota: its writes must name a model and layout "
                "(a scope), or they could not be counted"
            )

    def namespace(self, p: Principal, model: str, layout: str) -> Namespace | None:
        """The caller's namespace: the request's model and layout, the token's tenant."""
        if not model and not layout:
            return None
        key = (p.tenant, model, layout)
        ns = self._ns.get(key)
        if ns is None:
            try:
                ns = _FixedNamespace(model, layout, p.tenant)
            except ConfigError as exc:
                raise InvalidValue(f"bad scope: {exc}") from None
            limit = self.config.max_namespaces_per_tenant
            self.names.add(ns.fingerprint(), p.tenant, model, limit=limit)  # no-op once known
            self._cover(p.tenant, ns.fingerprint())
            with self._ns_lock:
                if len(self._ns) > _NS_CACHE:
                    self._ns.clear()
                self._ns[key] = ns
        return ns

    def _cover(self, tenant: str, fp: bytes) -> None:
        """Bring a namespace under its tenant's quota (a no-op without one, or once in)."""
        q = self.quotas.get(tenant)
        if q is None:
            return
        with self._budget_lock:
            old = self._budgets.get(tenant)
            if old is not None and fp in old.namespaces:
                return
            budget = q.budget((old.namespaces if old is not None else frozenset()) | {fp})
            self.node.set_budget(budget)
            self._budgets[tenant] = budget

    def quota_usage(self, p: Principal) -> dict[str, int]:
        """Per tenant with a quota (all for an admin, else the caller's own): bytes held
        per tier (``quota_used_<tier>@<tenant>``) and writes in flight."""
        with self._budget_lock:
            budgets = [(t, b) for t, b in self._budgets.items() if p.admin or t == p.tenant]
        out: dict[str, int] = {}
        for tenant, b in budgets:
            usage = self.node.usage(b)
            for kind, nbytes in usage.tier_bytes.items():
                out[f"quota_used_{kind.value}@{tenant}"] = nbytes
            out[f"quota_inflight@{tenant}"] = usage.reservations
            out[f"quota_inflight_bytes@{tenant}"] = usage.reserved_bytes
        return out

    # -- counters (kvstore/observe/names.py) -------------------------------------------

    def count_reads(self, p: Principal, reads: Sequence[BlockRead | KVStoreError | None]) -> None:
        """Per-tenant hits (by the tier the read found) and misses of one request."""
        tally: dict[str, int] = {}
        for r in reads:
            if isinstance(r, BlockRead):
                name = f"hits_{(r.hit or r.tier).value}"
            elif r is None:
                name = "misses"
            else:
                continue  # a failed key is neither
            tally[name] = tally.get(name, 0) + 1
        for name, n in tally.items():
            self.counters.inc(name, n, tenant=p.tenant)

    def count_out(self, p: Principal, path: str, nbytes: int) -> None:
        """Payload bytes handed to a reader over ``path`` (shm, tcp, grpc)."""
        if nbytes:
            self.counters.inc(f"bytes_out_{path}", nbytes)
            self.counters.inc(f"bytes_out_{path}", nbytes, tenant=p.tenant)

    def count_put(self, p: Principal, path: str, nbytes: int) -> None:
        """A committed put of ``nbytes`` payload bytes over ``path``."""
        c, t = self.counters, p.tenant
        c.inc(f"bytes_in_{path}", nbytes)
        c.inc(f"bytes_in_{path}", nbytes, tenant=t)
        c.inc("puts", tenant=t)
        c.inc("bytes_in", nbytes, tenant=t)

    def refused(self, p: Principal, exc: KVStoreError) -> KVStoreError:
        """Count a write refused by a quota; returns the refusal, the item's result."""
        if isinstance(exc, QuotaExceeded):
            self.counters.inc("quota_refusals")
            self.counters.inc("quota_refusals", tenant=p.tenant)
        return exc

    def stalled(self, tenant: str) -> None:
        """A socket put whose payload stopped coming (its FILL lease expired)."""
        self.counters.inc("puts_stalled")
        self.counters.inc("puts_stalled", tenant=tenant)
