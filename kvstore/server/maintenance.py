"""Admin operations on one node, behind the Evict, Scan, Export, Import and Purge RPCs.

These are what ``kvstore evict`` and ``kvstore drain`` run on a server. They address
blocks by their *stored* keys (already scoped by tenant, kvstore/server/auth.py) rather than
by a caller's keys: an operator acts on every tenant's blocks, and a block moved to
another node must keep the exact key and namespace fingerprint its owner reads it by.
Filters by tenant or model go through the gateway's namespace registry
(kvstore/server/namespaces.py); an exported block carries its fingerprint's (tenant, model)
when this node knows them, and an import records them, so the filters keep selecting
a block after a drain moved it. Every entry point checks the admin flag first. Wire
formats stay in service.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.blocks import ValueInfo
from kvstore.errors import CorruptBlock, InvalidValue, KVStoreError, LimitExceeded, Unavailable
from kvstore.keys import as_key
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.server.gateway import Gateway
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from kvstore.wire.codec import MAX_SCAN

__all__ = ["EvictSpec", "ExportedBlock", "ImportItem", "Maintenance", "ScanSpec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvictSpec:
    """An admin eviction as requested: tier, byte target and filters (see store.proto)."""

    tier: str
    target_bytes: int = 0
    tenant: str = ""
    model: str = ""
    key_prefix: bytes = b""
    idle_s: float = 0.0
    dry_run: bool = False
    list_limit: int = 0


@dataclass(frozen=True, slots=True)
class ScanSpec:
    """Which blocks a Scan lists (see store.proto); "" / b"" matches any."""

    tenant: str = ""
    model: str = ""
    key_prefix: bytes = b""


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    """One stored block handed out for a move: packed header, payload, and the
    (tenant, model) of its namespace fingerprint ("" when this node does not know them)."""

    header: bytes
    payload: bytes
    tenant: str = ""
    model: str = ""


@dataclass(frozen=True, slots=True)
class ImportItem:
    """One block moved in from another node, under its stored key; ``tenant`` and
    ``model`` name its namespace fingerprint when the source knew them (both or neither)."""

    key: bytes
    info: ValueInfo
    payload: bytes
    checksum: int
    namespace_fp: bytes
    tenant: str = ""
    model: str = ""


class Maintenance:
    """Admin operations over one Gateway (and its node)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.node = gateway.node

    def evict(self, p: Principal, spec: EvictSpec) -> EvictResult:
        """Evict blocks matching the spec's filters down to its byte target."""
        p.require_admin("evict")
        kind = self.gw.tier(spec.tier)
        if spec.idle_s < 0:
            raise InvalidValue(f"idle_s must be >= 0, got {spec.idle_s}")
        namespaces = None
        if spec.tenant or spec.model:
            namespaces = self.gw.books.names.select(spec.tenant, spec.model)
        flt = BlockFilter(namespaces, spec.key_prefix, spec.idle_s)
        res = self.node.evict_where(
            kind, spec.target_bytes, flt, dry_run=spec.dry_run, list_limit=spec.list_limit
        )
        log.info(
            "evict %s to %d bytes%s: %d blocks (%d bytes), %d pinned skipped",
            spec.tier,
            spec.target_bytes,
            " (dry run)" if spec.dry_run else "",
            res.moved,
            res.nbytes,
            res.skipped_pinned,
        )
        return res

    def scan(
        self, p: Principal, limit: int, tier: str = "", spec: ScanSpec | None = None
    ) -> tuple[list[tuple[bytes, TierKind, int, bytes]], bool]:
        """Up to ``limit`` (at most MAX_SCAN) stored blocks as (key, tier, size,
        namespace fp), the ones ``spec`` selects, and whether more matched than were
        returned."""
        p.require_admin("scan")
        kind = self.gw.tier(tier) if tier else None
        flt = None
        if spec is not None and (spec.tenant or spec.model or spec.key_prefix):
            namespaces = None
            if spec.tenant or spec.model:
                namespaces = self.gw.books.names.select(spec.tenant, spec.model)
            flt = BlockFilter(namespaces, spec.key_prefix)
        n = min(max(limit, 1), MAX_SCAN)
        rows = self.node.scan(n + 1, kind, flt)
        return list(rows[:n]), len(rows) > n

    def export(
        self, p: Principal, keys: Sequence[bytes], budget: int
    ) -> list[ExportedBlock | None]:
        """Each stored key's block, None when absent; at most ``budget`` payload bytes in
        all (LimitExceeded past it: ask for fewer keys)."""
        p.require_admin("export")
        self.gw.check_batch(len(keys))
        out: list[ExportedBlock | None] = []
        for key in keys:
            blk = self.node.open_read(as_key(key))
            if blk is None:
                out.append(None)
                continue
            try:
                budget -= blk.header.payload_len
                if budget < 0:
                    raise LimitExceeded("exported payloads exceed one message; export fewer keys")
                tenant, model = self.gw.books.names.get(blk.header.namespace_fp) or ("", "")
                try:  # host() first: device bytes are checked, the header then says so
                    payload = blk.host().tobytes()
                except CorruptBlock:  # counted and dropped by the node
                    out.append(None)
                    continue
                out.append(ExportedBlock(blk.header.pack(), payload, tenant, model))
            finally:
                self.node.close_read(blk)
        self.gw.books.counters.inc("exported_blocks", sum(1 for o in out if o is not None))
        return out

    def import_blocks(self, p: Principal, items: Sequence[ImportItem]) -> list[bool | KVStoreError]:
        """Store each block under its stored key: True stored, False already present,
        or that block's error (a checksum mismatch included). The names a stored or
        present block came with are recorded for admin filters."""
        p.require_admin("import")
        self.gw.check_batch(len(items))
        if self.gw.draining:
            raise Unavailable("this node is draining: it takes no blocks; import elsewhere")
        out: list[bool | KVStoreError] = []
        for item in items:
            try:
                out.append(self._import_one(item))
            except KVStoreError as exc:
                out.append(exc)
        self.gw.books.counters.inc("imported_blocks", sum(1 for o in out if o is True))
        return out

    def _import_one(self, item: ImportItem) -> bool:
        if len(item.payload) != item.info.nbytes:
            raise InvalidValue(
                f"payload is {len(item.payload)} bytes, meta says {item.info.nbytes}"
            )
        named = bool(item.tenant or item.model)
        if named and not (item.tenant and item.model and item.namespace_fp):
            raise InvalidValue("an imported block's names need a tenant, a model and its fp")
        res = self.node.reserve(as_key(item.key), item.info, namespace_fp=item.namespace_fp or None)
        if res is None:  # stored already
            self._record_names(item)
            return False
        try:
            res.write(item.payload)
        except BaseException:
            self.node.abort(res)
            raise
        stored = self.node.commit(res, expected_checksum=item.checksum)
        self._record_names(item)
        return stored

    def _record_names(self, item: ImportItem) -> None:
        if item.tenant and item.model:
            self.gw.books.names.add(item.namespace_fp, item.tenant, item.model)

    def purge(self, p: Principal, keys: Sequence[bytes]) -> int:
        """Remove stored keys; how many were present (pinned ones go at last unpin)."""
        p.require_admin("purge")
        self.gw.check_batch(len(keys))
        n = self.node.remove([as_key(k) for k in keys])
        self.gw.books.counters.inc("purged_blocks", n)
        return n
