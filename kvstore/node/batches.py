"""A node's batches of puts and reads as one submission of device copies.

StoreNode.batch_put and batch_get_into go through here. Each item's bytes are queued
on the call's batches (kvstore/copies/engine.py ``Batches``: one per engine and device,
on a side stream ordered after the caller's stream and the device's ordered stream, by
events) when its tier's payload can queue them (``Payload.queue_write`` /
``queue_copy_to``: a device tensor into or out of the HBM slab, D2D; out of or into the
DRAM slab, D2H / H2D straight from registered memory or through pinned staging), and
the call waits once at the end. Anything else (a host value, an SSD read that could
not be promoted, a departure from the GPU that must be checked as it lands) is copied
at once, as ``put`` / ``get_into`` copy it.

Two-phase writes hold: a queued put stays reserved (invisible) until its copy is
known done. A DRAM put has an event of its own, so block i is hashed on the host
(its landed checksum) and committed while the copies after it still run; an HBM put
commits after the batch's one wait, its checksum pending (kvstore/tiers/hashbook.py).
A read stays pinned until the wait. Per-key outcomes are those of the one-by-one
calls: True, False, or the item's error. A copy that fails as it is queued fails its
own item; one that fails as it runs fails its item and every item of the call still
waiting on the stream after it (their bytes cannot be vouched for), and each of those
reservations is aborted, never committed. A reservation that finds the top tier full
of the call's own reservations first settles what is queued, then retries once, so a
batch larger than the tier behaves as its puts one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvstore.blocks import BlockHeader, describe
from kvstore.copies.engine import Batches
from kvstore.errors import CapacityError, KVStoreError
from kvstore.keys import Namespace
from kvstore.node.writes import Reservation, WritePath
from kvstore.tiers.base import Payload, Pending

__all__ = ["get_all", "put_all"]

Outcome = bool | KVStoreError


class Pinned(Protocol):
    """What a read needs of a pinned block (StoreNode's BlockRead)."""

    header: BlockHeader
    _bytes: Payload


P = TypeVar("P", bound=Pinned)


class _Puts:
    """One batch_put call: its batches, and the reservations queued on them."""

    def __init__(self, writes: WritePath, out: list[Outcome]) -> None:
        self.writes = writes
        self.out = out
        self.batches = Batches(after_slab=True)
        self.queued: list[tuple[int, Reservation, Pending]] = []

    def put(self, i: int, key: bytes, value: Any, namespace: Namespace | None) -> None:
        try:
            res = self.writes.reserve(key, describe(value), namespace, None)
        except CapacityError:
            if not self.queued:
                raise
            self.settle()  # room held by this call's own reservations: commit them first
            res = self.writes.reserve(key, describe(value), namespace, None)
        if res is None:
            self.out[i] = False
            return
        try:
            pending = res._bytes.queue_write(value, self.batches)
            if pending is None:  # copied at once, as put copies it
                self.out[i] = self.writes.commit(res, None, res.write(value))
                return
        except BaseException:
            self.writes.abort(res)
            raise
        self.queued.append((i, res, pending))

    def settle(self) -> None:
        """Commit what is queued: items with an event of their own as each lands, the
        rest after the one wait; a failed copy aborts its reservation."""
        queued, self.queued = self.queued, []
        try:
            later = []
            for i, res, pending in queued:
                if not pending.own:
                    later.append((i, res))
                    continue
                try:
                    landed = pending.landed()
                except KVStoreError as exc:
                    self.writes.abort(res)
                    self.out[i] = exc
                    continue
                self._commit(i, res, landed)
            try:
                self.batches.finish()
            except KVStoreError as exc:
                for i, res in later:
                    self.writes.abort(res)
                    self.out[i] = exc
                later = []
            for i, res in later:
                self._commit(i, res, None)
        finally:
            try:
                self.batches.finish()  # nothing in flight into an extent once we leave
            finally:
                for _, res, _ in queued:
                    self.writes.abort(res)  # a no-op for what was committed
                self.batches = Batches(after_slab=True)

    def _commit(self, i: int, res: Reservation, landed: int | None) -> None:
        try:
            self.out[i] = self.writes.commit(res, None, landed)
        except KVStoreError as exc:
            self.out[i] = exc


def put_all(
    writes: WritePath,
    keys: Sequence[bytes],
    values: Sequence[Any],
    namespace: Namespace | None,
) -> list[Outcome]:
    """StoreNode.batch_put (see the module docstring)."""
    out: list[Outcome] = [False] * len(keys)
    puts = _Puts(writes, out)
    try:
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            try:
                puts.put(i, key, value, namespace)
            except KVStoreError as exc:
                out[i] = exc
    finally:
        puts.settle()
    return out


def get_all(
    keys: Sequence[bytes],
    outs: Sequence[Any],
    open_read: Callable[[bytes], P | None],
    copy_now: Callable[[P, Any], bool],
    close_read: Callable[[P], None],
    counted: Callable[[int], None],
) -> list[Outcome]:
    """StoreNode.batch_get_into (see the module docstring): ``open_read`` pins a block
    (None: a miss), ``copy_now`` is get_into's copy of a pinned block, ``counted`` adds
    bytes read out."""
    res: list[Outcome] = [False] * len(keys)
    queued: list[tuple[int, P]] = []
    batches = Batches(after_slab=True)
    try:
        for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
            try:
                blk = open_read(key)
                if blk is None:
                    continue
                try:
                    if blk._bytes.queue_copy_to(blk.header, out, batches):
                        queued.append((i, blk))
                        blk = None  # unpinned after the wait
                    else:
                        res[i] = copy_now(blk, out)
                finally:
                    if blk is not None:
                        close_read(blk)
            except KVStoreError as exc:
                res[i] = exc
        try:
            batches.finish()
        except KVStoreError as exc:
            for i, _ in queued:
                res[i] = exc
        else:
            for i, blk in queued:
                res[i] = True
                counted(blk.header.payload_len)
    finally:
        try:
            batches.finish()
        finally:
            for _, blk in queued:
                close_read(blk)
    return res
