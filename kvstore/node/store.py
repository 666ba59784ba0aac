"""StoreNode: one host's share of the pool, behind put / get / get_into / exists.

Writes land in the fastest memory tier (HBM if configured, else DRAM) in two
phases: reserve space, fill it, commit (checksum, header, visible) or abort. Reads
pin a block, copy it straight into the caller's buffer and unpin. Where blocks live
and how they move between tiers is the TierChain's job (chain.py), which also holds
the one lock and its concurrency contract; a block is visible only after its commit
because reservations are not in the chain's index.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks import (
    HEADER_SIZE,
    BlockHeader,
    ValueInfo,
    checksum,
    copy_payload,
    describe,
    materialize,
)
from kvstore.config import NodeConfig
from kvstore.errors import (
    BlockTooLarge,
    ClosedError,
    CorruptBlock,
    InvalidValue,
    KVStoreError,
    ReservationError,
)
from kvstore.events import BlockEvent, EventQueue
from kvstore.keys import BlockKey, Namespace, as_key
from kvstore.node.chain import TierChain, _Entry
from kvstore.node.eviction import BlockFilter, EvictResult
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexWriter
from kvstore.tiering import TierKind
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier

__all__ = ["BlockRead", "Reservation", "StoreNode"]

_ZERO_NS = b"\x00" * 16


@dataclass(slots=True)
class Reservation:
    """Space for one block, reserved but not yet visible (phase one of a put).

    Fill ``payload`` (a writable uint8 view of exactly ``info.nbytes``), then pass
    the reservation to :meth:`StoreNode.commit` or :meth:`StoreNode.abort`.
    """

    key: BlockKey
    info: ValueInfo
    namespace_fp: bytes
    level: int
    offset: int
    size: int
    payload: Any
    token: int
    done: bool = False


@dataclass(slots=True)
class BlockRead:
    """A pinned block: header and payload stay valid until it is closed.

    ``offset`` is the block's extent in its memory tier's slab (the payload starts
    ``HEADER_SIZE`` bytes later), which is what a same-host client maps; it is -1
    when the payload is a private buffer (an SSD read that could not be promoted).
    ``hit`` is the tier the read found it in (an SSD hit promoted to DRAM has
    ``tier`` DRAM and ``hit`` SSD): what per-tenant hit counters count.
    """

    header: BlockHeader
    payload: Any  # numpy uint8 view (DRAM), CUDA tensor (HBM) or a buffer read from SSD
    tier: TierKind
    offset: int
    _entry: _Entry = field(repr=False)
    _closed: bool = field(default=False, repr=False)
    hit: TierKind | None = None


class StoreNode:
    """A node's tiers behind put / get / get_into / exists / match_prefix / remove.

    Used in process (``kvstore demo``) and behind the gRPC service. Open on
    construction; use as a context manager or call :meth:`close`.
    """

    def __init__(self, config: NodeConfig | None = None, **overrides: Any) -> None:
        self.config = config.replace(**overrides) if config else NodeConfig.load(**overrides)
        c = self.config
        self._reservations: dict[int, Reservation] = {}  # guarded by the chain's lock
        self._tokens = itertools.count(1)
        self.events = EventQueue(c.event_queue)
        self.counters = NodeCounters()
        self._chain = TierChain(c.policy, self.events, self.counters)
        self._lock = self._chain.lock
        self._tiers = self._chain.tiers
        self._closed = False
        try:
            if c.hbm_bytes:
                self._chain.add_tier(MemoryTier(TierKind.HBM, c.hbm_bytes, warm=c.warm))
            if c.dram_bytes:
                dram = MemoryTier(
                    TierKind.DRAM, c.dram_bytes, shm_name=c.shm_name or None, warm=c.warm
                )
                self._chain.add_tier(dram)
            if c.ssd_path:
                self._chain.add_tier(DiskTier(c.ssd_path, c.ssd_bytes))
                self._chain.reload_disk()
        except BaseException:
            self.close()
            raise

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
        """Name of the DRAM segment under /dev/shm, for same-host clients."""
        for t in self._tiers:
            if isinstance(t, MemoryTier) and t.kind is TierKind.DRAM:
                return t.shm_name
        return None

    def publish_index(self) -> str:
        """Publish where DRAM blocks sit in a shared-memory index, for same-host readers
        that copy without a lease (kvstore/shm/index.py); a server calls this, an
        embedded node has no such readers. Returns the index's name ("" without DRAM)."""
        self._check_open()
        for t in self._tiers:
            if isinstance(t, MemoryTier) and t.kind is TierKind.DRAM and t.shm_name:
                if self._chain.published is None:
                    self._chain.publish_dram(IndexWriter(t.shm_name, t.capacity))
                assert self._chain.published is not None
                return self._chain.published.name
        return ""

    def touch(self, keys: Sequence[bytes]) -> int:
        """Record hits that readers served themselves from the published index: the
        eviction order and hit counters see them as reads. Returns how many of the
        blocks are still stored."""
        return self._chain.touch([as_key(k) for k in keys])

    def close(self) -> None:
        """Release every tier (the shared-memory segment is unlinked); idempotent."""
        self._closed = True
        self._chain.close()

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
    ) -> Reservation:
        """Phase one of a put: reserve space in the top tier, evicting if needed.

        Raises BlockTooLarge if the block can never fit, CapacityError if every
        candidate is pinned. The block stays invisible until :meth:`commit`.
        ``namespace_fp`` (without ``namespace``) stores a block moved from another node
        under the fingerprint it was written with (no layout check: that was done then).
        """
        self._check_open()
        k = as_key(key)
        if value_info.nbytes > self.config.max_value_bytes:
            raise BlockTooLarge(
                f"block of {value_info.nbytes} bytes exceeds max_value_bytes "
                f"{self.config.max_value_bytes}"
            )
        nsfp = _ZERO_NS if namespace_fp is None else namespace_fp
        if len(nsfp) != len(_ZERO_NS):
            raise InvalidValue(f"namespace_fp is {len(nsfp)} bytes, expected {len(_ZERO_NS)}")
        if namespace is not None:
            value_info.check_layout(namespace.kv_layout)
            nsfp = namespace.fingerprint()
        size = HEADER_SIZE + value_info.nbytes
        top = self._tiers[0]
        if not top.fits_ever(size):
            raise BlockTooLarge(f"block of {size} bytes exceeds the {top.kind.value} tier")
        offset = self._chain.make_room(0, size)
        assert isinstance(top, MemoryTier)
        res = Reservation(
            k, value_info, nsfp, 0, offset, size, top.payload(offset, value_info.nbytes), 0
        )
        with self._lock:
            res.token = next(self._tokens)
            self._reservations[res.token] = res
        return res

    def commit(self, res: Reservation, *, expected_checksum: int | None = None) -> bool:
        """Phase two: checksum the filled payload, write the header, make it visible.

        ``expected_checksum`` (from a remote writer) is verified against the bytes
        that arrived; a mismatch aborts and raises CorruptBlock. Returns False when
        the key was already present (the new copy is dropped: keys name content).
        """
        tier = self._tiers[res.level]
        assert isinstance(tier, MemoryTier)
        with self._lock:
            if res.done or self._reservations.pop(res.token, None) is None:
                raise ReservationError("reservation already committed or aborted")
            res.done = True
        try:
            csum = _payload_checksum(res.payload)
            if expected_checksum is not None and csum != expected_checksum:
                self.counters.inc("corrupt_transfer")
                raise CorruptBlock("payload checksum mismatch after transfer")
            info = res.info
            header = BlockHeader(
                info.dtype, info.shape, info.kind, res.key, res.namespace_fp, info.nbytes, csum
            )
            tier.write_header(res.offset, header.pack())
        except BaseException:
            with self._lock:
                tier.free(res.offset)
            raise
        with self._lock:
            if res.key in self._chain.index:
                tier.free(res.offset)
                return False
            self._chain.insert_locked(res.key, res.level, res.offset, res.size, header)
        self.counters.inc("puts")
        self.counters.inc("bytes_in", info.nbytes)
        return True

    def abort(self, res: Reservation) -> None:
        """Drop a reservation and free its space; aborting twice is harmless."""
        with self._lock:
            if self._reservations.pop(res.token, None) is None:
                return
            res.done = True
            self._tiers[res.level].free(res.offset)  # type: ignore[attr-defined]

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        """Store one block (tensor, array or bytes). False if the key was already stored."""
        info = describe(value)
        with self._lock:
            if as_key(key) in self._chain.index:
                return False
        res = self.reserve(key, info, namespace=namespace)
        try:
            tier = self._tiers[res.level]
            assert isinstance(tier, MemoryTier)
            tier.write_payload(res.offset, value)
        except BaseException:
            self.abort(res)
            raise
        return self.commit(res)

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[bool | KVStoreError]:
        """Put each pair; each item reports its own outcome (True, False, or the error)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        out: list[bool | KVStoreError] = []
        for k, v in zip(keys, values, strict=True):
            try:
                out.append(self.put(k, v, namespace=namespace))
            except KVStoreError as exc:
                out.append(exc)
        return out

    # -- reads -------------------------------------------------------------------------------

    def open_read(self, key: bytes, *, namespace: Namespace | None = None) -> BlockRead | None:
        """Pin a block until :meth:`close_read`; None on a miss (or a namespace mismatch).

        Memory tiers give a view of the stored bytes (no copy); an SSD hit is read,
        verified and promoted first. Eviction never takes a pinned block, and its
        bytes are never freed or reused while the read is open.
        """
        self._check_open()
        nsfp = None if namespace is None else namespace.fingerprint()
        got = self._chain.acquire(as_key(key), nsfp)
        if got is None:
            return None
        entry, level, offset = got
        try:
            tier = self._tiers[level]
            if isinstance(tier, MemoryTier):
                payload = tier.payload(offset, entry.header.payload_len)
                return BlockRead(entry.header, payload, tier.kind, offset, entry, hit=tier.kind)
            read = self._chain.read_disk(entry, level)
        except BaseException:
            self._chain.release(entry)
            raise
        if read is None:
            self._chain.release(entry)
            return None
        payload, offset = read
        kind = self._tiers[0].kind if offset >= 0 else TierKind.SSD
        return BlockRead(entry.header, payload, kind, offset, entry, hit=TierKind.SSD)

    def close_read(self, blk: BlockRead) -> None:
        """Unpin a block from :meth:`open_read`; closing twice is harmless."""
        if not blk._closed:
            blk._closed = True
            self._chain.release(blk._entry)

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
            if blk is None:
                return False
            if blk.tier is TierKind.HBM:
                tier = self._tiers[0]
                assert isinstance(tier, MemoryTier)
                tier.copy_out_tensor(blk.payload, blk.header, out)
            else:
                copy_payload(blk.header, blk.payload, out)
            self.counters.inc("bytes_out", blk.header.payload_len)
            return True

    def get(self, key: bytes, *, namespace: Namespace | None = None) -> Any:
        """A fresh copy of a block, of the kind that was stored; None on a miss."""
        with self.pin(key, namespace=namespace) as blk:
            if blk is None:
                return None
            payload = blk.payload
            if blk.tier is TierKind.HBM:
                payload = payload.cpu().numpy()
            self.counters.inc("bytes_out", blk.header.payload_len)
            return materialize(blk.header, payload)

    def batch_get_into(
        self, keys: Sequence[bytes], outs: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[bool | KVStoreError]:
        """get_into for each pair; per-key results (True hit, False miss, or the error)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} outputs")
        res: list[bool | KVStoreError] = []
        for k, o in zip(keys, outs, strict=True):
            try:
                res.append(self.get_into(k, o, namespace=namespace))
            except KVStoreError as exc:
                res.append(exc)
        return res

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (any tier). Does not count as a hit."""
        ks = [as_key(k) for k in keys]
        with self._lock:
            return [k in self._chain.index for k in ks]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored: the reusable prefix, in blocks."""
        ks = [as_key(k) for k in keys]
        n = 0
        with self._lock:
            for k in ks:
                if k not in self._chain.index:
                    break
                n += 1
        return n

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        return self._chain.tier_of(as_key(key))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks; returns how many were present. Pinned ones go at last unpin."""
        ks = [as_key(k) for k in keys]
        n = 0
        with self._lock:
            for k in ks:
                e = self._chain.index.get(k)
                if e is not None:
                    self._chain.drop_locked(e)
                    n += 1
        return n

    # -- admin and observability -------------------------------------------------------------

    def evict(self, tier: TierKind, target_bytes: int) -> int:
        """Demote (or drop, from the last tier) blocks until ``tier`` uses at most
        ``target_bytes``; pinned blocks are skipped. Returns how many blocks went."""
        return self._chain.evict(tier, target_bytes)

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
        reports what would go and moves nothing. See TierChain.evict_where."""
        self._check_open()
        return self._chain.evict_where(
            tier, target_bytes, flt, dry_run=dry_run, list_limit=list_limit
        )

    def scan(
        self, limit: int, tier: TierKind | None = None, flt: BlockFilter | None = None
    ) -> list[tuple[BlockKey, TierKind, int, bytes]]:
        """Up to ``limit`` stored blocks as (key, tier, size, namespace fp), cheaply: what a drain
        pages through while it removes what it moved; ``flt`` keeps only matches."""
        return self._chain.scan(limit, tier, flt)

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        return self._chain.keys(tier)

    def snapshot(self) -> list[tuple[BlockKey, TierKind, int]]:
        """Every stored block as (key, tier, size), consistent at one instant.

        What a directory publisher re-lists from after it missed events."""
        return self._chain.snapshot()

    def drain_events(self, limit: int | None = None) -> list[BlockEvent]:
        """Take pending BlockStored / BlockRemoved / BlockMoved events, oldest first."""
        return self.events.drain(limit)

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity/used/blocks and the node's counters, as plain data."""
        per, pinned = self._chain.tier_stats()
        return {
            "node_id": self.node_id,
            "tiers": per,
            "blocks": sum(p["blocks"] for p in per.values()),
            "pinned": pinned,
            "events_dropped": self.events.dropped,
            "counters": self.counters.snapshot(),
        }


def _payload_checksum(payload: Any) -> int:
    if hasattr(payload, "device") and getattr(payload.device, "type", "cpu") == "cuda":
        return checksum(payload.cpu().numpy())
    return checksum(payload)
