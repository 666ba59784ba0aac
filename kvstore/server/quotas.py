"""Per-tenant quotas: what one tenant may hold on a node and have in flight.

Without quotas one tenant can take a whole tier: fill DRAM with its blocks, or hold it
with half-written puts whose payload never arrives, and every other tenant's writes
fail (issue 17). Quotas live in the tokens file (``--tokens-file``), beside the tokens
they limit, one table per tenant, and are read once at start (a bad one stops the
server with the entry named)::

    [quotas.alpha]
    dram = "4GiB"            # header + payload bytes of its blocks in DRAM
    ssd = "100GiB"           # ... and on the SSD tier (hbm too, on a node with one)
    reservations = 32        # puts in flight at once (reserved, not yet committed)
    reserved_bytes = "1GiB"  # bytes of those puts
    connections = 64         # data connections open at once

Every field is optional, and a tenant without a table is unlimited (as before quotas).
A limit is a positive whole number of bytes (sizes as in every setting:
kvstore/config.py ``parse_size``) or of reservations.

How they are enforced (the gateway's books, kvstore/server/books.py, hand each tenant's
quota to the node as a Budget over the fingerprints of its namespaces;
kvstore/node/budgets.py applies it under the index's lock, where blocks are stored,
moved and removed):

- A put that would take the tenant past ``reservations`` or ``reserved_bytes`` is
  refused before anything is reserved (``QuotaExceeded``, code ``quota_exceeded``);
  that item fails, the rest of the batch goes on.
- A tenant at its quota of a tier makes room there from its OWN blocks, least recently
  used first: out of DRAM they are demoted to the SSD, off the SSD (the last tier) they
  leave the node. Another tenant's blocks are never taken for it. When none of its own
  blocks can go (every one is being read or moved, or the quota is all writes in
  flight), the put is refused with ``QuotaExceeded``.
- Under its quota a tenant's write takes room like any other (the tier's eviction
  policy picks the victim). A quota bounds what a tenant holds; it reserves nothing.
  With the quotas of a tier adding up to at most its capacity, no tenant's writes push
  another's blocks out of it.
- Puts in flight count against the top tier's quota as well: half-written blocks are
  held space.
- A tenant with a quota must name a model and layout on its writes (a scope): a block
  without one carries no namespace fingerprint, so it could not be counted.
- A data connection that would take the tenant past ``connections`` is refused right
  after its HELLO authenticated it (``QuotaExceeded``), so one tenant's connections,
  idle or dribbling, cannot take every slot of ``max_connections`` from the others.
  A client opens one connection per thread that calls at once (and, on a sharded
  node, one per shard it calls: this limit is each shard's, not divided).

The quota is per node: a cluster of N nodes lets a tenant hold up to N times it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvstore.config import ServerConfig, parse_size
from kvstore.errors import ConfigError
from kvstore.node.budgets import Budget
from kvstore.server.auth import read_tokens_file
from kvstore.tenants import DEFAULT_TENANT
from kvstore.tier_kinds import TierKind

__all__ = ["Quotas", "TenantQuota"]

_TIERS = {t.value: t for t in TierKind}  # hbm, dram, ssd
_COUNTS = ("reservations", "connections")
_FIELDS = (*_TIERS, *_COUNTS, "reserved_bytes")


@dataclass(frozen=True, slots=True, eq=False)
class TenantQuota:
    """One tenant's limits (absent or 0: unlimited)."""

    tenant: str
    tier_bytes: Mapping[TierKind, int] = field(default_factory=lambda: MappingProxyType({}))
    reservations: int = 0
    reserved_bytes: int = 0
    connections: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier_bytes", MappingProxyType(dict(self.tier_bytes)))

    def share(self, count: int) -> TenantQuota:
        """This quota over ``count`` (see :meth:`Quotas.share`)."""

        def part(v: int) -> int:
            return -(-v // count) if v > 0 else 0

        return TenantQuota(
            self.tenant,
            {t: part(v) for t, v in self.tier_bytes.items()},
            part(self.reservations),
            part(self.reserved_bytes),
            self.connections,  # each shard has its own connections: not divided
        )

    def budget(self, namespaces: Iterable[bytes]) -> Budget:
        """The node's Budget for this quota over the tenant's namespace fingerprints."""
        return Budget(
            f"tenant {self.tenant!r}",
            frozenset(namespaces),
            self.tier_bytes,
            self.reservations,
            self.reserved_bytes,
        )


class Quotas:
    """Tenant -> TenantQuota, loaded once from the tokens file."""

    def __init__(self, quotas: Iterable[TenantQuota] = ()) -> None:
        self._by_tenant = {q.tenant: q for q in quotas}

    @classmethod
    def from_config(cls, config: ServerConfig) -> Quotas:
        """The ``[quotas.<tenant>]`` tables of ``config.tokens_file`` (none: no quotas)."""
        if not config.tokens_file:
            return cls()
        return cls.load(config.tokens_file)

    @classmethod
    def load(cls, path: str) -> Quotas:
        """Read and validate the quotas of a tokens file (TOML, or JSON by extension)."""
        doc = read_tokens_file(path)
        raw = doc.get("quotas", {})
        if not isinstance(raw, dict):
            raise ConfigError(f"tokens_file {path!r}: quotas must be a table of tenants")
        tenants = {DEFAULT_TENANT}  # the auth_token's and an anonymous caller's
        for item in doc.get("tokens") or ():
            if isinstance(item, dict) and isinstance(item.get("tenant"), str):
                tenants.add(item["tenant"])
        out = []
        for tenant, table in raw.items():
            where = f"tokens_file {path!r} quotas.{tenant}"
            if tenant not in tenants:
                raise ConfigError(f"{where}: no token in this file is for tenant {tenant!r}")
            out.append(_parse(where, tenant, table))
        return cls(out)

    def share(self, count: int) -> Quotas:
        """Each tenant's quota divided among ``count`` shards of one node (rounded up,
        at least 1 of anything limited): a key's shard is a uniform hash, so a tenant
        near its quota is near it on every shard, and the node as a whole holds at most
        the quota (plus rounding)."""
        if count <= 1:
            return self
        return Quotas(q.share(count) for q in self._by_tenant.values())

    def get(self, tenant: str) -> TenantQuota | None:
        """A tenant's quota; None when it has none (unlimited)."""
        return self._by_tenant.get(tenant)

    def __iter__(self) -> Any:
        return iter(self._by_tenant.values())

    def __len__(self) -> int:
        return len(self._by_tenant)


def _parse(where: str, tenant: str, table: object) -> TenantQuota:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of limits ({', '.join(_FIELDS)})")
    unknown = set(table) - set(_FIELDS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown limit(s) {', '.join(sorted(unknown))}; use {', '.join(_FIELDS)}"
        )
    tiers = {_TIERS[name]: _size(where, name, v) for name, v in table.items() if name in _TIERS}
    counts = {name: _count(where, name, table[name]) for name in _COUNTS if name in table}
    nbytes = (
        _size(where, "reserved_bytes", table["reserved_bytes"]) if "reserved_bytes" in table else 0
    )
    return TenantQuota(tenant, tiers, reserved_bytes=nbytes, **counts)


def _count(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}.{name}: expected a whole number > 0, got {value!r}")
    return value


def _size(where: str, name: str, value: object) -> int:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(f"{where}.{name}: expected a size like '4GiB', got {value!r}")
    n = parse_size(value, f"{where}.{name}")
    if n <= 0:
        raise ConfigError(f"{where}.{name}: must be > 0 (leave it out for no limit)")
    return n
