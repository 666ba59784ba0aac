"""WritePath: a node's two-phase writes, reserve -> fill -> commit | abort.

A reservation is a place claimed in the top tier (claims.py, through the mover when
victims must go down first) and counted as a write in flight; it is not in the index,
so no reader sees it until its commit checksums the bytes, seals the header and makes
it visible (BlockIndex.commit). A reservation takes the index's lock once (more only
to make room) and a commit once. A write credit (:meth:`WritePath.reserve_credit`) is
a reservation whose key comes later, with its bytes (:meth:`WritePath.bind`).

Concurrency contract. A Reservation may be filled from any thread, but it is settled
(committed, aborted or bound) exactly once: ``Reservation._settle`` is a lock taken
without blocking and never released, so the second settler sees it held and backs off
(ReservationError, or nothing for an abort). Its place belongs to whoever holds the
Reservation until then; the index's lock (state.py) is taken only by the index's calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks import HEADER_SIZE, KIND_BYTES, PENDING, BlockHeader, ValueInfo
from kvstore.config import NodeConfig
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    InvalidValue,
    ReservationError,
    StorageError,
)
from kvstore.keys import BlockKey, Namespace, as_key
from kvstore.node.index import BlockIndex
from kvstore.node.mover import TierMover
from kvstore.observe.counters import NodeCounters
from kvstore.tiers.base import Payload, Tier

__all__ = ["Reservation", "WritePath"]

_ZERO_NS = b"\x00" * 16
_NO_KEY = BlockKey(b"\x00" * 16)  # a credit's, until bind() names the block


@dataclass(slots=True)
class Reservation:
    """Space for one block, reserved but not yet visible (phase one of a put).

    Fill it, then pass it to :meth:`StoreNode.commit` or :meth:`StoreNode.abort`: write
    ``payload`` (a writable host uint8 array of exactly ``info.nbytes``; where the tier
    is on a device it is a staging buffer that the commit copies in) or call
    :meth:`write` with a whole value. ``shm_offset`` is the extent a same-host writer
    fills in the node's shared segment (-1 when the top tier is not shared).
    """

    key: BlockKey
    info: ValueInfo
    namespace_fp: bytes
    level: int
    offset: int
    size: int
    shm_offset: int
    _bytes: Payload = field(repr=False)
    _settle: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def payload(self) -> Any:
        """The host buffer to fill (the stored bytes themselves in host memory)."""
        return self._bytes.fill_buffer()

    def write(self, value: Any) -> int | None:
        """Fill the reservation with a whole value (tensor, array, bytes), in one copy.
        Returns the xxh3 of what landed when the copy took it on the way (a device
        tensor into host memory): the commit's ``landed_checksum``."""
        return self._bytes.write(value)

    @property
    def done(self) -> bool:
        """Whether it was committed or aborted."""
        return self._settle.locked()


class WritePath:
    """Reservations in a node's top tier and their commits; StoreNode's write half."""

    def __init__(
        self,
        config: NodeConfig,
        tiers: list[Tier],
        index: BlockIndex,
        mover: TierMover,
        counters: NodeCounters,
    ) -> None:
        self._config = config
        self._tiers = tiers
        self._index = index
        self._mover = mover
        self._counters = counters

    def shared_level(self) -> int:
        """The fastest tier same-host clients may write in place (the shared DRAM
        segment), or -1 when none is."""
        for level, tier in enumerate(self._tiers):
            if tier.shm_name is not None:
                return level
        return -1

    def _level(self, shared: bool) -> int:
        if not shared or self._tiers[0].shm_name is not None:
            return 0
        level = self.shared_level()
        if level < 0:
            raise StorageError("this node shares no memory: same-host writes use the data socket")
        return level

    def reserve(
        self,
        key: bytes,
        value_info: ValueInfo,
        namespace: Namespace | None,
        nsfp: bytes | None,
        shared: bool = False,
    ) -> Reservation | None:
        """See StoreNode.reserve."""
        k = as_key(key)
        if value_info.nbytes > self._config.max_value_bytes:
            raise BlockTooLarge(
                f"block of {value_info.nbytes} bytes exceeds max_value_bytes "
                f"{self._config.max_value_bytes}"
            )
        nsfp = _ZERO_NS if nsfp is None else nsfp
        if len(nsfp) != len(_ZERO_NS):
            raise InvalidValue(f"namespace_fp is {len(nsfp)} bytes, expected {len(_ZERO_NS)}")
        if namespace is not None:
            value_info.check_layout(namespace.kv_layout)
            nsfp = namespace.fingerprint()
        size = HEADER_SIZE + value_info.nbytes
        level = self._level(shared) if shared else 0
        place = self._mover.make_room(level, size, unless_stored=k, fp=nsfp, reservation=True)
        if place is None:
            return None
        top = self._tiers[level]  # written out in both reserves: a helper costs every put a call
        fill = top.payload(place, value_info.nbytes)
        if fill is None:
            self._index.discard(k, level, place, reserved=(nsfp, size))
            raise StorageError(f"the {top.kind.value} tier cannot take reservations")
        shm_offset = place if top.shm_name is not None else -1
        return Reservation(k, value_info, nsfp, level, place, size, shm_offset, fill)

    def reserve_credit(
        self, nbytes: int, namespace: Namespace | None, shared: bool = False
    ) -> Reservation:
        """See StoreNode.reserve_credit."""
        if nbytes > self._config.max_value_bytes:
            raise BlockTooLarge(
                f"block of {nbytes} bytes exceeds max_value_bytes {self._config.max_value_bytes}"
            )
        nsfp = _ZERO_NS if namespace is None else namespace.fingerprint()
        size = HEADER_SIZE + nbytes
        level = self._level(shared) if shared else 0
        place = self._mover.make_room(level, size, fp=nsfp, reservation=True, spare_own=True)
        assert place is not None  # only a key already stored gives no place
        top = self._tiers[level]
        fill = top.payload(place, nbytes)
        if fill is None:
            self._index.discard(_NO_KEY, level, place, reserved=(nsfp, size))
            raise StorageError(f"the {top.kind.value} tier cannot take reservations")
        shm_offset = place if top.shm_name is not None else -1
        info = ValueInfo("uint8", (nbytes,), KIND_BYTES, nbytes)
        return Reservation(_NO_KEY, info, nsfp, level, place, size, shm_offset, fill)

    @staticmethod
    def bind(
        credit: Reservation, key: bytes, info: ValueInfo, namespace: Namespace | None
    ) -> Reservation:
        """See StoreNode.bind."""
        k = as_key(key)
        if info.nbytes != credit.info.nbytes:
            raise InvalidValue(
                f"a block of {info.nbytes} bytes in a credit of {credit.info.nbytes}"
            )
        nsfp = _ZERO_NS if namespace is None else namespace.fingerprint()
        if nsfp != credit.namespace_fp:
            raise InvalidValue("a credit reserved for another namespace")
        if namespace is not None:
            info.check_layout(namespace.kv_layout)
        if not credit._settle.acquire(blocking=False):
            raise ReservationError("the credit was used or aborted already")
        c = credit
        return Reservation(k, info, nsfp, c.level, c.offset, c.size, c.shm_offset, c._bytes)

    def commit(
        self, res: Reservation, expected_checksum: int | None, landed_checksum: int | None
    ) -> bool:
        """See StoreNode.commit."""
        if not res._settle.acquire(blocking=False):
            raise ReservationError("reservation already committed or aborted")
        info = res.info
        try:
            fill = res._bytes
            fill.flush()
            if expected_checksum is None and fill.defers_checksum:
                csum = PENDING  # the tier takes it off the critical path (hashbook.py)
            elif landed_checksum is not None and fill.fills_in_place:
                csum = landed_checksum
            else:
                csum = fill.checksum()
            if expected_checksum is not None and csum != expected_checksum:
                self._counters.inc("corrupt_transfer")
                raise CorruptBlock("payload checksum mismatch after transfer")
            header = BlockHeader(
                info.dtype, info.shape, info.kind, res.key, res.namespace_fp, info.nbytes, csum
            )
            self._tiers[res.level].seal(res.offset, header)
        except BaseException:
            self._index.discard(res.key, res.level, res.offset, reserved=_reserved(res))
            raise
        if not self._index.commit(res.key, res.level, res.offset, header):
            return False
        self._counters.inc("puts")
        self._counters.inc("bytes_in", info.nbytes)
        return True

    def abort(self, res: Reservation) -> None:
        """See StoreNode.abort."""
        if res._settle.acquire(blocking=False):
            self._index.discard(res.key, res.level, res.offset, reserved=_reserved(res))


def _reserved(res: Reservation) -> tuple[bytes, int]:
    """What the index counts a reservation under: (namespace fp, size)."""
    return res.namespace_fp, res.size
