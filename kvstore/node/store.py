"""StoreNode: one host's share of the pool, behind put / get / get_into / exists.

Writes land in the fastest tier (HBM if configured, else DRAM) in two phases:
reserve space, fill it, commit (checksum, header, visible) or abort: the WritePath's
(writes.py, with the Reservation record). Reads pin a block, copy it straight into the
caller's buffer and unpin, here. Where blocks live is the BlockIndex's (index.py,
which owns the one lock; its contract is written in state.py); how their bytes move
between tiers is the TierMover's (mover.py). A block is visible only after its commit
because a reservation is not in the index. A reservation takes the index's lock once
(more only to make room) and a commit once; a read pins and unpins, once each.

A server may give a set of namespaces a Budget (:meth:`StoreNode.set_budget`,
budgets.py): reservations and room-making for those namespaces then stay within it,
and an over-budget namespace makes room from its own blocks only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks import BlockHeader, ValueInfo, describe, materialize
from kvstore.config import NodeConfig
from kvstore.errors import ClosedError, CorruptBlock, KVStoreError
from kvstore.events import BlockEvent, EventQueue
from kvstore.keys import BlockKey, Namespace, as_key
from kvstore.node.batches import get_all, put_all
from kvstore.node.budgets import Budget, Usage
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.node.index import BlockIndex
from kvstore.node.mover import TierMover
from kvstore.node.state import Entry
from kvstore.node.writes import Reservation, WritePath
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import Payload, Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier

# Reservation is defined in writes.py; it is named here too because StoreNode's
# callers (kvstore/server) take it from the node's public module with BlockRead.
__all__ = ["BlockRead", "Reservation", "StoreNode"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockRead:
    """A pinned block: header and payload stay valid until it is closed.

    :meth:`host` gives the payload's bytes in host memory (a view of them where they
    lie in host memory, one copy from a device, hashed and checked as it lands: then
    ``header`` carries the checksum they were checked against, which a block put into
    HBM may learn only here; CorruptBlock when they fail it, and the node drops the
    block); :meth:`copy_to` copies them into a caller's buffer. Whatever sends a
    block's bytes off the node takes them from :meth:`host` before it packs
    ``header``. ``offset`` is the block's extent in its tier's slab (the payload
    starts ``HEADER_SIZE`` bytes later), -1 when the payload is a private buffer (an SSD
    read that could not be promoted); ``shm_offset`` is that extent when a same-host
    client may map it (the tier is the node's shared segment), else -1. ``hit`` is the
    tier the read found it in (an SSD hit promoted to DRAM has ``tier`` DRAM and ``hit``
    SSD): what per-tenant hit counters count.
    """

    header: BlockHeader
    _bytes: Payload = field(repr=False)
    tier: TierKind
    offset: int
    shm_offset: int
    _entry: Entry = field(repr=False)
    _closed: bool = field(default=False, repr=False)
    hit: TierKind | None = None
    _lost: Callable[[BlockRead], None] | None = field(default=None, repr=False)
    _landed: Any = field(default=None, repr=False)

    def host(self) -> Any:
        """The payload as a flat uint8 host array (a view where it lies in host memory),
        checked as it left a device (CorruptBlock)."""
        if self._landed is None:
            try:
                self.header, self._landed = self._bytes.land(self.header)
            except CorruptBlock:
                if self._lost is not None:
                    self._lost(self)
                raise
        return self._landed

    @property
    def payload(self) -> Any:
        """Same as :meth:`host`."""
        return self.host()

    def copy_to(self, out: Any) -> None:
        """Copy the payload into ``out`` (stored dtype and byte size, else LayoutMismatch)."""
        self._bytes.copy_to(self.header, out)


class StoreNode:
    """A node's tiers behind put / get / get_into / exists / match_prefix / remove.

    Used in process (``kvstore demo``) and behind the gRPC service. Open on
    construction; use as a context manager or call :meth:`close`.
    """

    def __init__(self, config: NodeConfig | None = None, **overrides: Any) -> None:
        self.config = config.replace(**overrides) if config else NodeConfig.load(**overrides)
        c = self.config
        self.events = EventQueue(c.event_queue)
        self.counters = NodeCounters()
        self._tiers: list[Tier] = []  # fastest first
        self._index = BlockIndex(self._tiers, c.policy, self.events, self.counters)
        self._mover = TierMover(self._tiers, self._index, self.counters)
        self._writes = WritePath(c, self._tiers, self._index, self._mover, self.counters)
        self._closed = False
        try:
            if c.hbm_bytes:
                hbm = MemoryTier(TierKind.HBM, c.hbm_bytes, device=c.hbm_device, warm=c.warm)
                self._add_tier(hbm)
            if c.dram_bytes:
                dram = MemoryTier(
                    TierKind.DRAM,
                    c.dram_bytes,
                    shm_name=c.shm_name or None,
                    shared=c.shared_dram,
                    warm=c.warm,
                    pin=True if c.hbm_bytes else None,  # see MemoryTier._pin_host
                )
                self._add_tier(dram)
            if c.ssd_path:
                self._add_tier(DiskTier(c.ssd_path, c.ssd_bytes))
        except BaseException:
            self.close()
            raise

    def _add_tier(self, tier: Tier) -> None:
        self._tiers.append(tier)
        self._index.add_tier(tier)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This node's id in the cluster."""
        return self.config.node_id

    @property
    def tiers(self) -> tuple[TierKind, ...]:
        """The tiers this node has, fastest first."""
        return tuple(t.kind for t in self._tiers)

    @property
    def shm_name(self) -> str | None:
        """Name of the DRAM segment under /dev/shm, for same-host clients (None: the
        node shares no memory)."""
        for t in self._tiers:
            if t.shm_name is not None:
                return t.shm_name
        return None

    def publish_index(self) -> str:
        """Publish where DRAM blocks sit in a shared-memory index, for same-host readers
        that copy without a lease (kvstore/shm/index.py); a server calls this, an
        embedded node has no such readers. Returns the index's name ("" without DRAM)."""
        self._check_open()
        for t in self._tiers:
            if t.shm_name is not None:
                writer = None if self._index.published else IndexWriter(t.shm_name, t.capacity)
                return self._index.publish(writer)
        return ""

    def touch(self, keys: Sequence[bytes]) -> int:
        """Record hits that readers served themselves from the published index: the
        eviction order and hit counters see them as reads. Returns how many of the
        blocks are still stored."""
        return self._index.touch([as_key(k) for k in keys])

    def close(self) -> None:
        """Release every tier (the shared-memory segment is unlinked); idempotent."""
        self._closed = True
        writer = self._index.close()
        if writer is not None:
            writer.close()
        for t in self._tiers:
            t.close()

    def __enter__(self) -> StoreNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store node is closed")

    # -- writes ----------------------------------------------------------------------------

    def reserve(
        self,
        key: bytes,
        value_info: ValueInfo,
        *,
        namespace: Namespace | None = None,
        namespace_fp: bytes | None = None,
        shared: bool = False,
    ) -> Reservation | None:
        """Phase one of a put: reserve space in the top tier, evicting if needed; None
        when the key is already stored (keys name content: there is nothing to write).
        ``shared``: in the fastest tier a same-host client can fill itself (the shared
        DRAM segment, below an HBM top tier), StorageError when the node shares none.

        Raises BlockTooLarge if the block can never fit, CapacityError if every
        candidate is pinned. The block stays invisible until :meth:`commit`.
        ``namespace_fp`` (without ``namespace``) stores a block moved from another node
        under the fingerprint it was written with (no layout check: that was done then).
        """
        self._check_open()
        return self._writes.reserve(key, value_info, namespace, namespace_fp, shared)

    def reserve_credit(
        self, nbytes: int, *, namespace: Namespace | None = None, shared: bool = False
    ) -> Reservation:
        """Space in the top tier for a block of ``nbytes`` whose key is not known yet: a
        same-host writer's next put fills it first and names it in the one request
        that commits it (kvstore/server/gateway.py, credits), which saves the put its
        reservation round trip. Counted against the namespace's budget like any
        reservation, but never granted by evicting the namespace's own blocks
        (QuotaExceeded then); :meth:`bind` gives it its key, :meth:`abort` frees it.
        ``shared`` as for :meth:`reserve`."""
        self._check_open()
        return self._writes.reserve_credit(nbytes, namespace, shared)

    def bind(
        self,
        credit: Reservation,
        key: bytes,
        info: ValueInfo,
        *,
        namespace: Namespace | None = None,
    ) -> Reservation:
        """The reservation of block ``key`` in a credit's space (:meth:`reserve_credit`),
        filled already; commit it as any other. Raises, leaving the credit as it was
        (the caller aborts it), when the block is not the credit's size or namespace,
        or does not fit the namespace's layout; ReservationError when the credit was
        bound or aborted already."""
        return self._writes.bind(credit, key, info, namespace)

    def commit(
        self,
        res: Reservation,
        *,
        expected_checksum: int | None = None,
        landed_checksum: int | None = None,
    ) -> bool:
        """Phase two: checksum the filled payload, write the header, make it visible.

        ``expected_checksum`` (from a remote writer) is verified against the bytes
        that arrived; a mismatch aborts and raises CorruptBlock. Returns False when
        the key was already present (the new copy is dropped: keys name content).

        ``landed_checksum`` is the xxh3 of the payload's bytes computed by whoever wrote
        them into ``res.payload``, as they landed (a receiver hashing each piece of a
        socket while the next arrives). Where the fill buffer is the stored bytes
        (``Payload.fills_in_place``: host memory) it stands for a second pass over
        them; the caller vouches that nothing else wrote the reservation meanwhile. A
        staged payload (a device's) is always hashed after its copy. A device tensor
        written whole into HBM commits with its checksum pending, unless
        ``expected_checksum`` must be verified (kvstore/tiers/hashbook.py, the rule).
        """
        return self._writes.commit(res, expected_checksum, landed_checksum)

    def abort(self, res: Reservation) -> None:
        """Drop a reservation and free its space; aborting twice is harmless."""
        self._writes.abort(res)

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        """Store one block (tensor, array or bytes). False if the key was already stored."""
        self._check_open()
        res = self._writes.reserve(key, describe(value), namespace, None)
        if res is None:
            return False
        try:
            landed = res.write(value)
        except BaseException:
            self._writes.abort(res)
            raise
        return self._writes.commit(res, None, landed)

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[bool | KVStoreError]:
        """Put each pair; each item reports its own outcome (True, False, or the error).
        Device tensors are copied as one submission with one wait (batches.py)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if self._closed:  # each item's outcome, as put reports it
            return [ClosedError("store node is closed") for _ in keys]
        return put_all(self._writes, keys, values, namespace)

    # -- reads -------------------------------------------------------------------------------

    def open_read(self, key: bytes, *, namespace: Namespace | None = None) -> BlockRead | None:
        """Pin a block until :meth:`close_read`; None on a miss (or a namespace mismatch).

        Memory tiers give a view of the stored bytes (no copy); an SSD hit is read,
        verified and promoted first. Eviction never takes a pinned block, and its
        bytes are never freed or reused while the read is open.
        """
        self._check_open()
        nsfp = None if namespace is None else namespace.fingerprint()
        got = self._index.pin(as_key(key), nsfp)
        if got is None:
            return None
        entry, level, place = got
        try:
            tier = self._tiers[level]
            header = entry.header
            payload = tier.payload(place, header.payload_len)
            if payload is not None:
                kind = tier.kind
                shm = -1 if tier.shm_name is None else place
                return BlockRead(header, payload, kind, place, shm, entry, False, kind, self._lost)
            read = self._mover.read_through(entry, level)
        except BaseException:
            self._index.unpin(entry)
            raise
        if read is None:
            self._index.unpin(entry)
            return None
        payload, place = read
        top = self._tiers[0]
        kind = top.kind if place >= 0 else tier.kind
        shm = place if place >= 0 and top.shm_name is not None else -1
        hit = tier.kind
        return BlockRead(entry.header, payload, kind, place, shm, entry, False, hit, self._lost)

    def _lost(self, blk: BlockRead) -> None:
        """A pinned block's bytes failed their checksum as they left a device: count
        it, say so, and drop it (a miss from now on; its place goes at the last unpin)."""
        self.counters.inc(f"corrupt_blocks_{blk.tier.value}")
        log.warning(
            "%s block %s failed its checksum leaving the device; dropped",
            blk.tier.value,
            blk.header.key.hex(),
        )
        self._index.remove([blk._entry.key])

    def close_read(self, blk: BlockRead) -> None:
        """Unpin a block from :meth:`open_read`; closing twice is harmless."""
        if not blk._closed:
            blk._closed = True
            self._index.unpin(blk._entry)

    @contextmanager
    def pin(self, key: bytes, *, namespace: Namespace | None = None) -> Iterator[BlockRead | None]:
        """``open_read`` for the span of a ``with`` body; yields None on a miss."""
        blk = self.open_read(key, namespace=namespace)
        try:
            yield blk
        finally:
            if blk is not None:
                self.close_read(blk)

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        """Copy a block into a preallocated tensor/array/buffer. False on a miss.

        ``out`` must have the stored dtype and byte size (LayoutMismatch otherwise).
        """
        with self.pin(key, namespace=namespace) as blk:
            return False if blk is None else self._copy_pinned(blk, out)

    def _copy_pinned(self, blk: BlockRead, out: Any) -> bool:
        try:
            blk._bytes.copy_to(blk.header, out)  # one call less than blk.copy_to
        except CorruptBlock:  # device bytes that failed their checksum leaving
            self._lost(blk)
            return False
        self.counters.inc("bytes_out", blk.header.payload_len)
        return True

    def get(self, key: bytes, *, namespace: Namespace | None = None) -> Any:
        """A fresh copy of a block, of the kind that was stored; None on a miss."""
        with self.pin(key, namespace=namespace) as blk:
            if blk is None:
                return None
            try:
                host = blk.host()
            except CorruptBlock:  # counted and dropped by _lost
                return None
            self.counters.inc("bytes_out", blk.header.payload_len)
            return materialize(blk.header, host)

    def batch_get_into(
        self, keys: Sequence[bytes], outs: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[bool | KVStoreError]:
        """get_into for each pair; per-key results (True hit, False miss, or the error).
        Copies into device tensors are one submission with one wait, each block pinned
        until it (batches.py)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} outputs")

        def open_read(key: bytes) -> BlockRead | None:
            return self.open_read(key, namespace=namespace)

        def counted(n: int) -> None:
            self.counters.inc("bytes_out", n)

        return get_all(keys, outs, open_read, self._copy_pinned, self.close_read, counted)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (any tier). Does not count as a hit."""
        return self._index.contains([as_key(k) for k in keys])

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored: the reusable prefix, in blocks."""
        return self._index.prefix_len([as_key(k) for k in keys])

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        return self._index.tier_of(as_key(key))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks; returns how many were present. Pinned ones go at last unpin."""
        return self._index.remove([as_key(k) for k in keys])

    # -- admin and observability -------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Limit what ``budget.namespaces`` may hold (replacing the budget of the same
        name): see kvstore/node/budgets.py for the rules."""
        self._index.set_budget(budget)

    def usage(self, budget: Budget) -> Usage:
        """Bytes per tier and writes in flight of a budget's namespaces, now."""
        return self._index.usage(budget)

    def evict(self, tier: TierKind, target_bytes: int) -> int:
        """Demote (or drop, from the last tier) blocks until ``tier`` uses at most
        ``target_bytes``; pinned blocks are skipped. Returns how many blocks went."""
        return self._mover.evict_where(tier, target_bytes).moved

    def evict_where(
        self,
        tier: TierKind,
        target_bytes: int,
        flt: BlockFilter | None = None,
        *,
        dry_run: bool = False,
        list_limit: int = 0,
    ) -> EvictResult:
        """Evict the blocks ``flt`` accepts until ``tier`` uses at most ``target_bytes``
        (admin ``kvstore evict``); pinned blocks are skipped and counted. ``dry_run``
        reports what would go and moves nothing. See TierMover.evict_where."""
        self._check_open()
        return self._mover.evict_where(
            tier, target_bytes, flt, dry_run=dry_run, list_limit=list_limit
        )

    def scan(
        self, limit: int, tier: TierKind | None = None, flt: BlockFilter | None = None
    ) -> list[tuple[BlockKey, TierKind, int, bytes]]:
        """Up to ``limit`` stored blocks as (key, tier, size, namespace fp), cheaply: what a drain
        pages through while it removes what it moved; ``flt`` keeps only matches."""
        return self._index.scan(limit, tier, flt)

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        return self._index.keys(tier)

    def snapshot(self) -> list[tuple[BlockKey, TierKind, int]]:
        """Every stored block as (key, tier, size), consistent at one instant.

        What a directory publisher re-lists from after it missed events."""
        return self._index.snapshot()

    def settle_checksums(self, timeout: float = 10.0) -> bool:
        """Wait until every block committed so far into a device tier has its checksum
        (the background hasher's, kvstore/tiers/hashbook.py); True when they all do.
        For tests, benchmarks and operators who want every block verifiable now."""
        return all(t.wait_hashed(timeout) for t in self._tiers)

    def take_events(self, limit: int | None = None) -> list[BlockEvent]:
        """Take pending BlockStored / BlockRemoved / BlockMoved events, oldest first."""
        return self.events.take(limit)

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity/used/blocks and the node's counters, as plain data."""
        per, pinned = self._index.stats()
        return {
            "node_id": self.node_id,
            "tiers": per,
            "blocks": sum(p["blocks"] for p in per.values()),
            "pinned": pinned,
            "events_dropped": self.events.dropped,
            "counters": self.counters.snapshot(),
        }
