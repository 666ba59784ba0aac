"""What both directories share: registrations, keepalive, epochs and publish state.

A directory implementation provides seven primitives (grant, create-if-absent,
replace-if-still-ours, wait for a record to go, keepalive, revoke, write a batch);
:class:`LeasedDirectory` builds registration, record updates, publishing and
lease-loss recovery on them once, so the embedded and the etcd directory cannot
drift apart in the parts that are subtle.

Publish state: each registration keeps ``desired`` (key -> (tier, size), what the
directory should hold for this node) and ``dirty`` (keys whose directory entry may
differ from ``desired``). Events update ``desired`` and mark keys dirty; a flush
writes the dirty keys (one op per key, so batches can go out concurrently without
reordering a key's history) and clears them only on success. After a lease loss the
node re-registers under a new lease (a new epoch) and marks every key dirty, since
the old lease took all of its entries with it.

The node record follows the same rule: ``info`` is what the record should say (a
drain sets ``draining``) and ``info_dirty`` says it may not say so yet. A flush
writes it before any block entry; a recovery re-registers with it, so a change made
before a lease loss survives the loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from kvstore.directory.base import (
    DEFAULT_TTL,
    MUTABLE_FIELDS,
    BlockSnapshot,
    Directory,
    NodeInfo,
    check_name,
)
from kvstore.errors import (
    ClosedError,
    ConflictError,
    InvalidValue,
    KVStoreError,
    LeaseExpired,
    NotFound,
)
from kvstore.events import BlockEvent, BlockMoved, BlockRemoved, BlockStored
from kvstore.tier_kinds import TierKind

__all__ = ["LeasedDirectory", "Value", "WriteOp"]

log = logging.getLogger(__name__)

Value = tuple[TierKind, int]
WriteOp = tuple[bytes, "Value | None"]  # (block key, (tier, size)) or (block key, None): delete


class _Registration:
    """One node's claim on its id, and what it has published.

    Concurrency contract: touched only from the owning directory's event loop.
    ``lock`` serializes flushes, recovery and changes to ``info``, so at most one
    write batch for this node is in flight, a key's updates reach the directory in
    order, and a recovery never re-registers a record older than the last update.
    ``apply`` and ``replace`` run without it (they only edit ``desired``/``dirty``).
    """

    __slots__ = (
        "_values",
        "desired",
        "dirty",
        "epochs",
        "info",
        "info_dirty",
        "keepalive",
        "lease",
        "lock",
        "lost",
        "revision",
        "ttl",
        "unknown_sizes",
    )

    def __init__(self, info: NodeInfo, lease: int, ttl: int) -> None:
        self.info = info
        self.info_dirty = False
        self.lease = lease
        self.ttl = ttl
        self.desired: dict[bytes, Value] = {}
        self.dirty: set[bytes] = set()
        self.lock = asyncio.Lock()
        self.revision = 0
        self.lost: KVStoreError | None = None
        self.keepalive: asyncio.Task[None] | None = None
        self.epochs = 1
        self.unknown_sizes = 0
        self._values: dict[Value, Value] = {}

    def _value(self, tier: TierKind, size: int) -> Value:
        v = (tier, size)
        return self._values.setdefault(v, v)  # few distinct values: share them

    def apply(self, events: Iterable[BlockEvent]) -> None:
        """Fold events into ``desired``; the last state of a key wins."""
        desired, dirty, value = self.desired, self.dirty, self._value
        for ev in events:
            key = ev.key if type(ev.key) is bytes else bytes(ev.key)
            kind = type(ev)
            if kind is BlockStored:
                desired[key] = value(ev.tier, ev.size)  # type: ignore[union-attr]
            elif kind is BlockRemoved:
                desired.pop(key, None)
            elif kind is BlockMoved:
                old = desired.get(key)
                if old is None:
                    self.unknown_sizes += 1  # its BlockStored was dropped; size unknown
                desired[key] = value(ev.dst, old[1] if old else 0)  # type: ignore[union-attr]
            else:
                raise TypeError(f"not a block event: {ev!r}")
            dirty.add(key)

    def replace(self, blocks: BlockSnapshot) -> None:
        """Make ``blocks`` the whole desired state (sizes of None keep the known size)."""
        old = self.desired
        new: dict[bytes, Value] = {}
        for k, (tier, size) in blocks.items():
            key = bytes(k)
            if size is None:
                prev = old.get(key)
                size = prev[1] if prev is not None else 0
            new[key] = self._value(tier, size)
        self.dirty.update(k for k in old if k not in new)
        self.dirty.update(k for k, v in new.items() if old.get(k) != v)
        self.desired = new

    def take_dirty(self) -> list[WriteOp]:
        """The pending writes, now (they go back with ``restore`` if the write fails)."""
        keys, self.dirty = self.dirty, set()
        get = self.desired.get
        return [(k, get(k)) for k in keys]

    def restore(self, ops: list[WriteOp]) -> None:
        self.dirty.update(k for k, _ in ops)


class LeasedDirectory(Directory):
    """Registration, keepalive, publishing and recovery over six storage primitives.

    Lifecycle state (``_state``): "unopened" -> "open" -> "closed", loop thread only.
    """

    def __init__(self, cluster: str) -> None:
        self.cluster = check_name("cluster", cluster)
        self._regs: dict[str, _Registration] = {}
        self._state = "unopened"

    # -- primitives ------------------------------------------------------------------------

    @abstractmethod
    async def _connect(self) -> None: ...

    @abstractmethod
    async def _disconnect(self) -> None: ...

    @abstractmethod
    async def _grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""

    @abstractmethod
    async def _create_node(self, info: NodeInfo, lease: int) -> NodeInfo | None:
        """Put the node record under ``lease`` only if no record exists. Returns None on
        success, else the live holder's record."""

    @abstractmethod
    async def _update_node(self, info: NodeInfo, lease: int) -> int:
        """Replace the node record with ``info`` only while the stored record is the one
        ``lease`` holds (never a newer life's); returns the revision. Raises LeaseExpired
        when the record is gone or held under another lease."""

    @abstractmethod
    async def _wait_node_gone(self, node_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the node's record to vanish; whether it did."""

    @abstractmethod
    async def _keepalive_once(self, lease: int) -> bool:
        """Refresh a lease; False when it no longer exists."""

    @abstractmethod
    async def _revoke(self, lease: int) -> None:
        """Drop a lease and everything under it (a missing lease is not an error)."""

    @abstractmethod
    async def _write(self, node_id: str, lease: int, ops: list[WriteOp]) -> int:
        """Write block entries under ``lease``; returns the revision where all are visible.
        Raises LeaseExpired if the lease is gone (nothing of this batch is then visible)."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self._state == "open":
            return
        if self._state == "closed":
            raise ClosedError("directory is closed")
        await self._connect()
        self._state = "open"

    async def close(self, *, deregister: bool = True) -> None:
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        regs, self._regs = list(self._regs.values()), {}
        for reg in regs:
            await _cancel(reg.keepalive)
        if deregister:
            for reg in regs:
                with contextlib.suppress(KVStoreError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._revoke(reg.lease), 2.0)
        await self._disconnect()

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedError(f"directory is {self._state}")

    def _reg(self, node_id: str) -> _Registration:
        self._check_open()
        reg = self._regs.get(node_id)
        if reg is None:
            raise NotFound(f"node {node_id!r} is not registered through this directory")
        return reg

    # -- registration ----------------------------------------------------------------------------

    async def register_node(
        self, info: NodeInfo, *, ttl: float = DEFAULT_TTL, wait: float = 0.0
    ) -> NodeInfo:
        self._check_open()
        if info.node_id in self._regs:
            raise ConflictError(f"node {info.node_id!r} is already registered here")
        ttl_s = max(1, math.ceil(ttl))
        stamped = await self._claim(info, ttl_s, wait)
        reg = _Registration(stamped, stamped.epoch, ttl_s)
        self._regs[info.node_id] = reg
        reg.keepalive = asyncio.create_task(
            self._keepalive_loop(reg), name=f"kvstore-keepalive-{info.node_id}"
        )
        return stamped

    async def _claim(self, info: NodeInfo, ttl: int, wait: float) -> NodeInfo:
        """Create the record under a fresh lease, waiting out a holder for ``wait`` s.

        The lease is granted per attempt (and revoked when the attempt loses), so no
        lease sits unrefreshed while we wait for a dead holder's lease to lapse.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            lease = await self._grant(ttl)
            try:
                holder = await self._create_node(info.with_epoch(lease), lease)
            except BaseException:
                await self._revoke_quietly(lease)
                raise
            if holder is None:
                return info.with_epoch(lease)
            await self._revoke_quietly(lease)
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._wait_node_gone(info.node_id, remaining):
                raise ConflictError(
                    f"node id {info.node_id!r} is held by a live node (host={holder.host}, "
                    f"boot_id={holder.boot_id}, epoch={holder.epoch:x}); "
                    "a restarted node may pass wait= the lease TTL to wait out its old life"
                )

    async def deregister(self, node_id: str) -> None:
        reg = self._reg(node_id)
        del self._regs[node_id]
        await _cancel(reg.keepalive)
        await self._revoke(reg.lease)

    def registration(self, node_id: str) -> NodeInfo:
        return self._reg(node_id).info

    async def update_node(self, node_id: str, **changes: Any) -> int:
        reg = self._reg(node_id)
        fixed = changes.keys() - MUTABLE_FIELDS
        if fixed:
            raise InvalidValue(
                f"cannot change {', '.join(sorted(fixed))} of a registered node "
                f"(changeable: {', '.join(sorted(MUTABLE_FIELDS))})"
            )
        async with reg.lock:
            new = replace(reg.info, **changes)
            if new != reg.info:
                reg.info, reg.info_dirty = new, True
        return await self._flush(reg)

    def pending(self, node_id: str) -> int:
        return len(self._reg(node_id).dirty)

    async def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(KVStoreError, asyncio.TimeoutError):
            await asyncio.wait_for(self._revoke(lease), 2.0)

    async def _keepalive_loop(self, reg: _Registration) -> None:
        """Refresh every third of the TTL; retry faster through an outage; recover a
        lost lease under a new epoch. Ends only when cancelled or the id is taken."""
        period = max(reg.ttl / 3.0, 0.2)
        delay = period
        while True:
            await asyncio.sleep(delay)
            lease = reg.lease
            try:
                if not await self._keepalive_once(lease):
                    await self._recover(reg, lease)
                    await self._flush(reg)
                elif reg.info_dirty:
                    await self._flush(reg)  # a record update an outage held back
                delay = period
            except ConflictError as exc:
                log.error("node %s lost its id for good: %s", reg.info.node_id, exc)
                return
            except KVStoreError as exc:
                log.debug("keepalive for %s failed, retrying: %s", reg.info.node_id, exc)
                delay = min(period, 0.25)

    async def _recover(self, reg: _Registration, failed_lease: int) -> None:
        """Re-register under a new lease after ``failed_lease`` was lost and mark every
        key dirty; the caller flushes."""
        async with reg.lock:
            if reg.lost is not None:
                raise reg.lost
            if reg.lease != failed_lease:
                return  # someone else already recovered
            lease = await self._grant(reg.ttl)
            info = reg.info.with_epoch(lease)
            try:
                holder = await self._create_node(info, lease)
            except BaseException:
                await self._revoke_quietly(lease)
                raise
            if holder is not None:
                await self._revoke_quietly(lease)
                reg.lost = ConflictError(
                    f"node {info.node_id!r} lost its lease and its id was taken by "
                    f"boot_id={holder.boot_id} on {holder.host}"
                )
                raise reg.lost
            reg.info, reg.lease, reg.info_dirty = info, lease, False
            reg.epochs += 1
            reg.dirty = set(reg.desired)
        log.warning("node %s lost its lease; re-registered as epoch %x", info.node_id, lease)

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, node_id: str, events: Iterable[BlockEvent]) -> int:
        reg = self._reg(node_id)
        reg.apply(events)
        return await self._flush(reg)

    async def sync(self, node_id: str, blocks: BlockSnapshot) -> int:
        reg = self._reg(node_id)
        reg.replace(blocks)
        return await self._flush(reg)

    async def flush(self, node_id: str) -> int:
        return await self._flush(self._reg(node_id))

    async def _flush(self, reg: _Registration) -> int:
        """Write the node record if it changed, then the dirty block entries; recover
        the lease (up to three times) when it turns out to be lost."""
        for _attempt in range(3):
            async with reg.lock:
                if reg.lost is not None:
                    raise reg.lost
                lease = reg.lease
                try:
                    return await self._flush_locked(reg, lease)
                except LeaseExpired:
                    pass
            await self._recover(reg, lease)
        raise LeaseExpired(f"node {reg.info.node_id!r} keeps losing its lease")

    async def _flush_locked(self, reg: _Registration, lease: int) -> int:
        if reg.info_dirty:
            rev = await self._update_node(reg.info, lease)
            reg.info_dirty = False
            reg.revision = max(reg.revision, rev)
        ops = reg.take_dirty()
        if not ops:
            return reg.revision
        try:
            rev = await self._write(reg.info.node_id, lease, ops)
        except BaseException:
            reg.restore(ops)
            raise
        reg.revision = max(reg.revision, rev)
        return reg.revision


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
