"""StoreNode: one host's share of the pool — tiers, placement, pins and events.

Writes land in the fastest memory tier (HBM if configured, else DRAM). When a tier
is full its policy picks a victim, which is demoted one tier down (HBM -> DRAM ->
SSD) or, from the last tier, dropped. An SSD hit is promoted back to the top tier.
A block lives in exactly one tier at a time.

Concurrency contract (the one lock, ``self._lock``, guards everything below it):
- the index ``_index`` (key -> _Entry), each entry's fields, the memory tiers'
  allocators, the policies, the reservations and the event queue order;
- byte copies (put fills, get copies, demotion and promotion I/O) run OUTSIDE the
  lock, on extents kept alive by a pin (``entry.pins``) or a reservation;
- an entry with ``pins > 0`` or ``state != READY`` is never chosen as a victim;
- a storage location that a pinned reader may still use is not freed when the
  entry moves or is removed: it goes to ``entry.stale`` and is freed at last unpin.
Readers therefore never see freed or reused bytes, and a block is visible only
after its commit: reservations are not in the index.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

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
    CapacityError,
    ClosedError,
    CorruptBlock,
    KVStoreError,
    NotFound,
    ReservationError,
)
from kvstore.events import BlockEvent, BlockMoved, BlockRemoved, BlockStored, EventQueue
from kvstore.keys import BlockKey, Namespace, as_key
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.stats import NodeCounters
from kvstore.tiers.base import Tier, TierKind
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier

__all__ = ["BlockRead", "Reservation", "StoreNode"]

log = logging.getLogger(__name__)
_ZERO_NS = b"\x00" * 16


class _State(IntEnum):
    READY = 0
    MOVING = 1  # being demoted or promoted; readable from its current place


@dataclass(slots=True)
class _Entry:
    key: bytes
    level: int  # index into StoreNode._tiers
    offset: int  # extent offset in a memory tier; -1 on disk
    size: int  # header + payload bytes
    header: BlockHeader
    pins: int = 0
    state: _State = _State.READY
    gone: bool = False  # removed from the index while pinned
    stale: list[tuple[int, int]] = field(default_factory=list)  # (level, offset) to free


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
    """

    header: BlockHeader
    payload: Any  # numpy uint8 view (DRAM), CUDA tensor (HBM) or a buffer read from SSD
    tier: TierKind
    offset: int
    _entry: _Entry = field(repr=False)
    _closed: bool = field(default=False, repr=False)


class StoreNode:
    """A node's tiers behind put / get / get_into / exists / match_prefix / remove.

    Used in process (``kvstore demo``) and behind the gRPC service. Open on
    construction; use as a context manager or call :meth:`close`.
    """

    def __init__(self, config: NodeConfig | None = None, **overrides: Any) -> None:
        self.config = config.replace(**overrides) if config else NodeConfig.load(**overrides)
        c = self.config
        self._lock = threading.Lock()
        self._index: dict[bytes, _Entry] = {}
        self._reservations: dict[int, Reservation] = {}
        self._tokens = itertools.count(1)
        self.events = EventQueue(c.event_queue)
        self.counters = NodeCounters()
        self._tiers: list[Tier] = []
        self._policies: list[EvictionPolicy] = []
        try:
            if c.hbm_bytes:
                self._add_tier(MemoryTier(TierKind.HBM, c.hbm_bytes, warm=c.warm))
            if c.dram_bytes:
                shm = c.shm_name or None
                self._add_tier(MemoryTier(TierKind.DRAM, c.dram_bytes, shm_name=shm, warm=c.warm))
            if c.ssd_path:
                self._add_tier(DiskTier(c.ssd_path, c.ssd_bytes))
                self._reload_disk()
        except BaseException:
            self.close()
            raise
        self._closed = False

    def _add_tier(self, tier: Tier) -> None:
        self._tiers.append(tier)
        self._policies.append(make_policy(self.config.policy, tier.capacity))

    def _reload_disk(self) -> None:
        """Re-list the SSD tier after a restart and announce what it still holds."""
        level = len(self._tiers) - 1
        disk = self._tiers[level]
        assert isinstance(disk, DiskTier)
        for key, header in disk.scan():
            size = header.total_len
            self._index[key] = _Entry(key, level, -1, size, header)
            self._policies[level].insert(key, size)
            self.events.put(BlockStored(key, TierKind.SSD, size, header.namespace_fp))

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

    def close(self) -> None:
        """Release every tier (the shared-memory segment is unlinked); idempotent."""
        self._closed = True
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
        self, key: bytes, value_info: ValueInfo, *, namespace: Namespace | None = None
    ) -> Reservation:
        """Phase one of a put: reserve space in the top tier, evicting if needed.

        Raises BlockTooLarge if the block can never fit, CapacityError if every
        candidate is pinned. The block stays invisible until :meth:`commit`.
        """
        self._check_open()
        k = as_key(key)
        if value_info.nbytes > self.config.max_value_bytes:
            raise BlockTooLarge(
                f"block of {value_info.nbytes} bytes exceeds max_value_bytes "
                f"{self.config.max_value_bytes}"
            )
        nsfp = _ZERO_NS
        if namespace is not None:
            value_info.check_layout(namespace.kv_layout)
            nsfp = namespace.fingerprint()
        size = HEADER_SIZE + value_info.nbytes
        top = self._tiers[0]
        if not top.fits_ever(size):
            raise BlockTooLarge(f"block of {size} bytes exceeds the {top.kind.value} tier")
        offset = self._make_room(0, size)
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
            if res.key in self._index:
                tier.free(res.offset)
                return False
            self._index[res.key] = _Entry(res.key, res.level, res.offset, res.size, header)
            self._policies[res.level].insert(res.key, res.size)
            self.events.put(BlockStored(res.key, tier.kind, res.size, res.namespace_fp))
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
            if as_key(key) in self._index:
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
        got = self._acquire(as_key(key), namespace)
        if got is None:
            return None
        entry, level, offset = got
        try:
            tier = self._tiers[level]
            if isinstance(tier, MemoryTier):
                payload = tier.payload(offset, entry.header.payload_len)
                return BlockRead(entry.header, payload, tier.kind, offset, entry)
            read = self._read_disk(entry, level)
        except BaseException:
            self._release(entry)
            raise
        if read is None:
            self._release(entry)
            return None
        payload, offset = read
        kind = self._tiers[0].kind if offset >= 0 else TierKind.SSD
        return BlockRead(entry.header, payload, kind, offset, entry)

    def close_read(self, blk: BlockRead) -> None:
        """Unpin a block from :meth:`open_read`; closing twice is harmless."""
        if not blk._closed:
            blk._closed = True
            self._release(blk._entry)

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
            return [k in self._index for k in ks]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored: the reusable prefix, in blocks."""
        ks = [as_key(k) for k in keys]
        n = 0
        with self._lock:
            for k in ks:
                if k not in self._index:
                    break
                n += 1
        return n

    def tier_of(self, key: bytes) -> TierKind | None:
        """Where a block lives now (None if absent)."""
        with self._lock:
            e = self._index.get(as_key(key))
            return None if e is None else self._tiers[e.level].kind

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks; returns how many were present. Pinned ones go at last unpin."""
        ks = [as_key(k) for k in keys]
        n = 0
        with self._lock:
            for k in ks:
                e = self._index.get(k)
                if e is not None:
                    self._drop_locked(e)
                    n += 1
        return n

    # -- pins -------------------------------------------------------------------------------

    def _acquire(self, key: bytes, namespace: Namespace | None) -> tuple[_Entry, int, int] | None:
        with self._lock:
            e = self._index.get(key)
            if e is None:
                self.counters.inc("misses")
                return None
            if namespace is not None and e.header.namespace_fp != namespace.fingerprint():
                self.counters.inc("namespace_mismatch")
                self.counters.inc("misses")
                return None
            e.pins += 1
            self._policies[e.level].touch(key)
            self.counters.inc(f"hits_{self._tiers[e.level].kind.value}")
            return e, e.level, e.offset

    def _release(self, e: _Entry) -> None:
        with self._lock:
            e.pins -= 1
            if e.pins == 0:
                self._free_stale_locked(e)

    def _free_stale_locked(self, e: _Entry) -> None:
        while e.stale:
            level, offset = e.stale.pop()
            tier = self._tiers[level]
            if isinstance(tier, MemoryTier):
                tier.free(offset)
            else:
                cur = self._index.get(e.key)
                if cur is None or self._tiers[cur.level] is not tier:
                    tier.delete(e.key)  # type: ignore[attr-defined]

    def _drop_locked(self, e: _Entry) -> None:
        """Forget an entry now; free its storage now or at its last unpin."""
        if self._index.get(e.key) is e:
            del self._index[e.key]
        e.gone = True
        self._policies[e.level].remove(e.key)
        self.events.put(BlockRemoved(e.key, self._tiers[e.level].kind))
        e.stale.append((e.level, e.offset))
        if e.pins == 0:
            self._free_stale_locked(e)

    # -- eviction, demotion, promotion -----------------------------------------------------------

    def _busy(self, key: Any) -> bool:
        e = self._index.get(key)
        return e is None or e.pins > 0 or e.state is not _State.READY

    def _make_room(self, level: int, size: int) -> int:
        """Make ``size`` bytes free in tier ``level``; returns an extent offset for
        memory tiers (-1 for disk). Demotes victims one tier down, outside the lock."""
        tier = self._tiers[level]
        if not tier.fits_ever(size):
            raise BlockTooLarge(f"block of {size} bytes exceeds the {tier.kind.value} tier")
        for _ in range(1 << 16):
            with self._lock:
                if isinstance(tier, MemoryTier):
                    off = tier.alloc(size)
                    if off is not None:
                        return off
                elif tier.has_room(size):  # type: ignore[attr-defined]
                    return -1
                victim_key = self._policies[level].pop_victim(self._busy)
                if victim_key is None:
                    raise CapacityError(
                        f"{tier.kind.value} tier is full and every block in it is pinned"
                    )
                victim = self._index[victim_key]  # type: ignore[index]
                if level + 1 == len(self._tiers):  # last tier: the victim leaves the node
                    self.counters.inc(f"evictions_{tier.kind.value}")
                    self._drop_locked(victim)
                    continue
                victim.state = _State.MOVING
                victim.pins += 1
            self._demote(victim)
        raise CapacityError(f"could not free {size} bytes in the {tier.kind.value} tier")

    def _demote(self, e: _Entry) -> None:
        """Move a victim (state MOVING, pinned by us) one tier down, or drop it."""
        src_level = e.level
        dst_level = src_level + 1
        src = self._tiers[src_level]
        assert isinstance(src, MemoryTier)
        new_offset: int | None = None
        if dst_level < len(self._tiers):
            try:
                new_offset = self._copy_down(e, src, dst_level)
            except KVStoreError as exc:
                log.warning("demotion of %s failed, dropping it: %s", e.key.hex(), exc)
                new_offset = None
        with self._lock:
            e.state = _State.READY
            e.pins -= 1
            if new_offset is None or e.gone:
                if not e.gone:
                    self.counters.inc(f"evictions_{src.kind.value}")
                    self._drop_locked(e)
                elif new_offset is not None:
                    self._discard_locked(e.key, dst_level, new_offset)
                return
            e.stale.append((src_level, e.offset))
            e.level, e.offset = dst_level, new_offset
            self._policies[dst_level].insert(e.key, e.size)
            self.events.put(BlockMoved(e.key, src.kind, self._tiers[dst_level].kind))
            self.counters.inc(f"demotions_{src.kind.value}")
            self.counters.inc(f"bytes_demoted_{src.kind.value}", e.size)
            if e.pins == 0:
                self._free_stale_locked(e)

    def _copy_down(self, e: _Entry, src: MemoryTier, dst_level: int) -> int:
        dst = self._tiers[dst_level]
        for _attempt in range(3):
            off = self._make_room(dst_level, e.size)
            try:
                if isinstance(dst, MemoryTier):
                    dst.write_header(off, e.header.pack())
                    dst.write_payload(off, src.payload(e.offset, e.header.payload_len))
                else:
                    payload = src.host_view(e.offset + HEADER_SIZE, e.header.payload_len)
                    dst.write(e.key, e.header.pack(), payload)  # type: ignore[attr-defined]
                return off
            except CapacityError:
                continue  # another writer took the room between check and write
        raise CapacityError(f"no room in the {dst.kind.value} tier after 3 tries")

    def _discard_locked(self, key: bytes, level: int, offset: int) -> None:
        tier = self._tiers[level]
        if isinstance(tier, MemoryTier):
            tier.free(offset)
        elif key not in self._index:
            tier.delete(key)  # type: ignore[attr-defined]

    def _read_disk(self, e: _Entry, level: int) -> tuple[Any, int] | None:
        """Read a pinned SSD block, verified; promote it to the top tier when possible.

        Returns (payload, offset): a view into the top tier and its extent after a
        promotion, else a private buffer and -1. None when the record is corrupt or
        gone (counted; the entry is dropped).
        """
        disk = self._tiers[level]
        assert isinstance(disk, DiskTier)
        n = e.header.payload_len
        with self._lock:
            promote = e.state is _State.READY and not e.gone and e.level == level
            if promote:
                e.state = _State.MOVING
        off: int | None = None
        top = self._tiers[0]
        assert isinstance(top, MemoryTier)
        if promote:
            try:
                off = self._make_room(0, e.size)
            except KVStoreError:
                off = None
        buf = top.payload(off, n) if off is not None else np.empty(n, dtype=np.uint8)
        try:
            disk.read_into(e.key, buf)
        except (CorruptBlock, NotFound) as exc:
            self.counters.inc("corrupt_blocks" if isinstance(exc, CorruptBlock) else "lost_blocks")
            log.warning("SSD block %s unreadable: %s", e.key.hex(), exc)
            with self._lock:
                if off is not None:
                    top.free(off)
                e.state = _State.READY
                if not e.gone:
                    self._drop_locked(e)
            return None
        if off is None:
            if promote:
                with self._lock:
                    e.state = _State.READY
            return buf, -1
        top.write_header(off, e.header.pack())
        with self._lock:
            e.state = _State.READY
            if e.gone:
                top.free(off)
                return np.array(buf), -1  # removed meanwhile: hand out a private copy
            self._policies[level].remove(e.key)
            e.stale.append((level, -1))
            e.level, e.offset = 0, off
            self._policies[0].insert(e.key, e.size)
            self.events.put(BlockMoved(e.key, TierKind.SSD, top.kind))
            self.counters.inc("promotions")
            self.counters.inc("bytes_promoted", e.size)
        return buf, off

    # -- admin and observability -------------------------------------------------------------

    def evict(self, tier: TierKind, target_bytes: int) -> int:
        """Demote (or drop, from the last tier) blocks until ``tier`` uses at most
        ``target_bytes``; pinned blocks are skipped. Returns how many blocks went."""
        level = self.tiers.index(tier)
        moved = 0
        while True:
            with self._lock:
                if self._tiers[level].used <= target_bytes:
                    return moved
                key = self._policies[level].pop_victim(self._busy)
                if key is None:
                    return moved
                e = self._index[key]  # type: ignore[index]
                if isinstance(self._tiers[level], MemoryTier) and level + 1 < len(self._tiers):
                    e.state, e.pins = _State.MOVING, e.pins + 1
                else:
                    self.counters.inc(f"evictions_{tier.value}")
                    self._drop_locked(e)
                    moved += 1
                    continue
            self._demote(e)
            moved += 1

    def keys(self, tier: TierKind | None = None) -> list[BlockKey]:
        """Stored keys, optionally of one tier (a snapshot)."""
        with self._lock:
            return [
                BlockKey(k)
                for k, e in self._index.items()
                if tier is None or self._tiers[e.level].kind is tier
            ]

    def drain_events(self, limit: int | None = None) -> list[BlockEvent]:
        """Take pending BlockStored / BlockRemoved / BlockMoved events, oldest first."""
        return self.events.drain(limit)

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity/used/blocks and the node's counters, as plain data."""
        with self._lock:
            per = {
                t.kind.value: {"capacity": t.capacity, "used": t.used, "blocks": 0}
                for t in self._tiers
            }
            for e in self._index.values():
                per[self._tiers[e.level].kind.value]["blocks"] += 1
            pinned = sum(1 for e in self._index.values() if e.pins)
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
