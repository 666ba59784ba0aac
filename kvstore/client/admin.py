"""The SDK's admin calls: filtered eviction, and the block moves a drain is made of.

Kept apart from NodeClient (kvstore/client/store.py), whose surface is the data path every
engine uses; these calls need an admin token and address blocks by their stored
(tenant-scoped) keys, as the node holds them. Each wraps one admin RPC of
proto/kvstore/v1/store.proto through :meth:`NodeClient.control`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import BlockHeader, ValueInfo
from kvstore.client.store import NodeClient
from kvstore.errors import KVStoreError, TransportError
from kvstore.wire.codec import error_of, meta_of

__all__ = ["AdminClient", "RawBlock", "StoredBlock"]


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block as a node lists it: stored key, tier, header + payload bytes, and the
    tenant and model of its namespace ("" when the node does not know them)."""

    key: bytes
    tier: str
    size: int
    tenant: str = ""
    model: str = ""


@dataclass(frozen=True, slots=True)
class RawBlock:
    """A block exported from a node: its stored key, header and payload, and the
    (tenant, model) its namespace fingerprint stands for ("" when the node did not know)."""

    key: bytes
    header: BlockHeader
    payload: bytes
    tenant: str = ""
    model: str = ""


class AdminClient:
    """Admin operations over an open NodeClient (whose token must be an admin's)."""

    def __init__(self, client: NodeClient) -> None:
        self.client = client

    @property
    def max_message_bytes(self) -> int:
        """The largest gRPC message the server accepts (its Info limits)."""
        limits = self.client.server_info.get("limits", {})
        return int(limits.get("max_message_bytes", 4 * 1024**2))

    def evict(
        self,
        tier: str,
        target_bytes: int = 0,
        *,
        tenant: str = "",
        model: str = "",
        key_prefix: bytes = b"",
        idle_s: float = 0.0,
        dry_run: bool = False,
        list_limit: int = 0,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Evict matching blocks of ``tier`` down to ``target_bytes`` (0: every match).

        Returns what moved (or would, for a dry run) as plain data: moved, demoted,
        dropped, bytes, skipped_pinned, used_before/after, capacity, next_tier, and the
        first ``list_limit`` chosen blocks (key as hex, size)."""
        req = pb.EvictRequest(
            tier=tier,
            target_bytes=target_bytes,
            tenant=tenant,
            model=model,
            key_prefix=key_prefix,
            idle_s=idle_s,
            dry_run=dry_run,
            list_limit=list_limit,
        )
        r = self.client.control("Evict", req, timeout=timeout)
        fields = ("moved", "demoted", "dropped", "bytes", "skipped_pinned", "used_before")
        out: dict[str, Any] = {"tier": tier, **{f: int(getattr(r, f)) for f in fields}}
        out.update(used_after=int(r.used_after), capacity=int(r.capacity))
        out.update(dry_run=bool(r.dry_run), next_tier=r.next_tier)
        out["blocks"] = [{"key": b.key.hex(), "size": int(b.size)} for b in r.blocks]
        return out

    def scan(
        self,
        limit: int,
        tier: str = "",
        *,
        tenant: str = "",
        model: str = "",
        key_prefix: bytes = b"",
        timeout: float | None = None,
    ) -> list[StoredBlock]:
        """Up to ``limit`` stored blocks, in no particular order; ``tenant``, ``model``
        and ``key_prefix`` narrow them as they narrow :meth:`evict`."""
        return self.scan_page(
            limit, tier, tenant=tenant, model=model, key_prefix=key_prefix, timeout=timeout
        )[0]

    def scan_page(
        self,
        limit: int,
        tier: str = "",
        *,
        tenant: str = "",
        model: str = "",
        key_prefix: bytes = b"",
        timeout: float | None = None,
    ) -> tuple[list[StoredBlock], bool]:
        """:meth:`scan`, and whether more blocks matched than came back (the server
        caps one reply at a few thousand)."""
        req = pb.ScanRequest(
            limit=limit, tier=tier, tenant=tenant, model=model, key_prefix=key_prefix
        )
        r = self.client.control("Scan", req, timeout=timeout)
        return [StoredBlock(b.key, b.tier, int(b.size), b.tenant, b.model) for b in r.blocks], bool(
            r.more
        )

    def export(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[RawBlock | None]:
        """Blocks by stored key (None: not there any more), payloads inline."""
        r = self.client.control("Export", pb.KeysRequest(keys=list(keys)), timeout=timeout)
        if len(r.blocks) != len(keys):
            raise TransportError(f"{len(r.blocks)} blocks exported for {len(keys)} keys")
        out: list[RawBlock | None] = []
        for key, ref in zip(keys, r.blocks, strict=True):
            err = error_of(ref.error)
            if err is not None:
                raise err
            if not ref.found:
                out.append(None)
                continue
            header = BlockHeader.unpack(ref.header)
            out.append(RawBlock(key, header, ref.payload, ref.tenant, ref.model))
        return out

    def import_blocks(
        self, blocks: Sequence[RawBlock], *, timeout: float | None = None
    ) -> list[bool | KVStoreError]:
        """Store blocks under their stored keys: True stored, False already there, or
        that block's error. The node checks each payload against its header's xxh3, and
        records each block's (tenant, model), when given, for its admin filters."""
        req = pb.PutRequest()
        for b in blocks:
            h = b.header
            info = ValueInfo(h.dtype, h.shape, h.kind, h.payload_len)
            req.items.add(
                key=b.key,
                meta=meta_of(info),
                checksum=h.checksum,
                payload=b.payload,
                namespace_fp=h.namespace_fp,
                tenant=b.tenant,
                model=b.model,
            )
        r = self.client.control("Import", req, timeout=timeout)
        return [error_of(res.error) or bool(res.stored) for res in r.results]

    def purge(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove blocks by stored key; how many were there."""
        r = self.client.control("Purge", pb.KeysRequest(keys=list(keys)), timeout=timeout)
        return int(r.removed)
