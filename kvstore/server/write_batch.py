"""The gateway's write batches: a write request's payloads, received straight into
reserved space, then verified and committed (the story is told in
kvstore/server/gateway.py).

The front end that decodes a request does not receive its payloads itself: it hands
the gateway a :class:`PayloadReceiver`, and the gateway asks it for each item's bytes
once the item's reservation is there (or asks it to skip them: the item was refused
or is stored already, and the stream must stay in step). A receiver on a data
connection is cut off by the lease reaper when a payload stops coming; one that copies
in process cannot stall and takes no lease.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.blocks import ValueInfo
from kvstore.config import ServerConfig
from kvstore.errors import InvalidValue, KVStoreError, TimeoutError_
from kvstore.keys import Namespace
from kvstore.node.store import Reservation, StoreNode
from kvstore.server.books import Books
from kvstore.server.layered import LayeredWrite, check_layered
from kvstore.server.leases import LeaseKind, LeaseTable
from kvstore.tenants import Principal

__all__ = [
    "UNHASHED",
    "Filled",
    "LayerReceiver",
    "PayloadReceiver",
    "WriteItem",
    "Writes",
]

_MAX_LAYERS = 4096  # a layer-by-layer write names its layer count; more is not a model


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One item of a write request: the caller's key, its value's description (or why
    it could not be decoded), the writer's xxh3 of the payload and its length."""

    key: bytes
    info: ValueInfo | KVStoreError
    checksum: int
    nbytes: int


class Filled(NamedTuple):
    """What receiving one item's payload gives back, for its commit to verify."""

    sent_sum: int | None  # the xxh3 the writer sent after the payload (None: the item's own)
    landed: int | None  # the xxh3 of the bytes as they landed (None: the commit hashes them)


UNHASHED = Filled(None, None)  # the item's own checksum, checked against the buffer


class PayloadReceiver(ABC):
    """Where a write request's payloads come from, asked by the gateway item by item.

    ``owner`` is the data connection receiving (its FILL leases end with it), or None
    for an in-process copy, which cannot stall and is not timed. ``at_once`` asks for
    a batch of several items to be received in one :meth:`receive_all` call.
    """

    owner: int | None = None
    at_once = False

    @abstractmethod
    def receive(self, target: Any, nbytes: int) -> Filled:
        """Put the next payload, ``nbytes`` long, into ``target`` (a host uint8 array)."""

    @abstractmethod
    def skip(self, nbytes: int) -> None:
        """Drop the next payload, ``nbytes`` long (and its trailer)."""

    def receive_all(self, targets: list[Any], sizes: Sequence[int]) -> list[Filled]:
        """Every payload of the batch: into its target, or dropped where it is None."""
        out: list[Filled] = []
        for target, n in zip(targets, sizes, strict=True):
            if target is None:
                self.skip(n)
                out.append(UNHASHED)
            else:
                out.append(self.receive(target, n))
        return out

    def cut(self) -> None:
        """Wake a receive that stalled past its deadline (called by the lease reaper).
        Only a receiver with an ``owner`` is timed, so only one has to say how."""
        raise NotImplementedError(f"{type(self).__name__} has no connection to cut")

    def stalled(self, nbytes: int, ttl_s: float) -> KVStoreError:
        """The error a stalled receive of ``nbytes`` raises once it was cut."""
        return TimeoutError_(
            f"put payload of {nbytes} bytes did not arrive within {ttl_s:.1f} s (put_grace_s "
            "+ nbytes / put_floor_bytes); its reservation was released"
        )


class LayerReceiver(PayloadReceiver):
    """A receiver for a layer-by-layer write: each item's layers arrive as separate
    payloads (:meth:`receive` of one layer's run), then one checksum per item."""

    @abstractmethod
    def closing_sums(self, count: int) -> list[tuple[int, bool]]:
        """The writer's (xxh3 over all layers, keep) of each of ``count`` items."""


class Writes:
    """Write requests against the node: reserve, fill through a receiver, commit."""

    def __init__(
        self, node: StoreNode, books: Books, leases: LeaseTable, config: ServerConfig
    ) -> None:
        self.node, self.books, self.leases, self.config = node, books, leases, config

    def fill_deadline_s(self, nbytes: int) -> float:
        """How long a write may hold a reservation while ``nbytes`` of payload arrive:
        the grace plus the time they take at the floor rate."""
        c = self.config
        return c.put_grace_s + nbytes / c.put_floor_bytes

    # -- the steps ---------------------------------------------------------------------

    def reserve(
        self, p: Principal, it: WriteItem, ns: Namespace | None, *, shared: bool = False
    ) -> Reservation | None:
        """Reserve space for one item (None: stored already), or raise why not;
        ``shared``: in the tier a same-host client fills itself (StoreNode.reserve)."""
        if isinstance(it.info, KVStoreError):
            raise it.info
        self.books.check_writer(p, ns)
        # it checks size, layout and the tenant's quota (kvstore/node/budgets.py)
        return self.node.reserve(p.scope(it.key), it.info, namespace=ns, shared=shared)

    def reserve_all(
        self,
        p: Principal,
        items: Sequence[WriteItem],
        ns: Namespace | None,
        check: Callable[[ValueInfo], None] | None = None,
    ) -> tuple[list[Reservation | None], list[bool | KVStoreError | None]]:
        """A reservation for each item (None where it is refused or stored already) and
        each item's result so far: None (reserved), False (stored already) or its error.
        Anything other than an item's own error releases what was reserved."""
        slots: list[Reservation | None] = []
        results: list[bool | KVStoreError | None] = []
        try:
            for it in items:
                res = None
                try:
                    if check is not None and not isinstance(it.info, KVStoreError):
                        check(it.info)
                    res = self.reserve(p, it, ns)
                    results.append(None if res is not None else False)
                except KVStoreError as exc:
                    results.append(self.books.refused(p, exc))
                slots.append(res)
        except BaseException:
            self.abort_all(slots)
            raise
        return slots, results

    def abort_all(self, slots: Sequence[Reservation | None]) -> None:
        for held in slots:
            if held is not None:
                self.node.abort(held)

    def commit(
        self, p: Principal, res: Reservation, checksum: int, path: str, landed: int | None = None
    ) -> bool:
        """Verify a filled reservation against the writer's xxh3 and make it visible:
        True stored, False stored already; raises (and counts) a rejected commit."""
        try:
            stored = self.node.commit(res, expected_checksum=checksum, landed_checksum=landed)
        except KVStoreError:
            self.books.counters.inc("rejected_commits")
            raise
        if stored:
            self.books.count_put(p, path, res.info.nbytes)
        return stored

    def settle(
        self, p: Principal, res: Reservation, it: WriteItem, filled: Filled, path: str
    ) -> bool | KVStoreError:
        """Commit one filled item against the writer's xxh3 (the item's, or the one sent
        after its payload), with the xxh3 its receiver computed as the bytes landed."""
        checksum = it.checksum if filled.sent_sum is None else filled.sent_sum
        try:
            return self.commit(p, res, checksum, path, filled.landed)
        except KVStoreError as exc:
            return exc

    def timed(
        self,
        p: Principal,
        rx: PayloadReceiver,
        nbytes: int,
        receive: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """Run ``receive(*args)`` (of ``nbytes`` payload bytes) under a FILL lease: past
        its deadline the reaper cuts the receiver off (``rx.cut``), and this raises
        ``rx.stalled``. The lease is always taken back here, never left behind."""
        leases, tenant = self.leases, p.tenant
        ttl = self.fill_deadline_s(nbytes)
        assert rx.owner is not None
        lease = leases.grant(LeaseKind.FILL, rx.cut, tenant, rx.owner, ttl_s=ttl)
        try:
            out = receive(*args)
        except BaseException:
            if leases.take(lease.id, tenant, LeaseKind.FILL) is None:
                raise rx.stalled(nbytes, ttl) from None
            raise
        if leases.take(lease.id, tenant, LeaseKind.FILL) is None:  # cut as it ended
            raise rx.stalled(nbytes, ttl)
        return out

    # -- the batches -------------------------------------------------------------------

    def write(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        rx: PayloadReceiver,
        path: str,
    ) -> list[bool | KVStoreError]:
        """One write request through ``rx`` (Gateway.write)."""
        self.books.check_batch(len(items))
        ns = self.books.namespace(p, model, layout)
        if rx.at_once and len(items) > 1:
            return self._at_once(p, items, ns, rx, path)
        out: list[bool | KVStoreError] = []
        for it in items:
            try:
                res = self.reserve(p, it, ns)
            except KVStoreError as exc:
                out.append(self.books.refused(p, exc))  # counted before its bytes are skipped
                rx.skip(it.nbytes)
                continue
            if res is None:
                rx.skip(it.nbytes)
                out.append(False)
                continue
            try:
                if rx.owner is None:
                    filled = rx.receive(res.payload, it.nbytes)
                else:
                    filled = self.timed(p, rx, it.nbytes, rx.receive, res.payload, it.nbytes)
            except BaseException:
                self.node.abort(res)  # a cut-short payload never becomes visible
                raise
            out.append(self.settle(p, res, it, filled, path))
        return out

    def _at_once(
        self,
        p: Principal,
        items: Sequence[WriteItem],
        ns: Namespace | None,
        rx: PayloadReceiver,
        path: str,
    ) -> list[bool | KVStoreError]:
        """Every item reserved first, every payload received in one call, then each
        item committed: for a transport that gains from posting every receive at once
        (UCX), at the price of holding the whole batch's space until its last byte."""
        slots, results = self.reserve_all(p, items, ns)
        sizes = [it.nbytes for it in items]
        targets = [None if r is None else r.payload for r in slots]
        try:
            if rx.owner is None:
                sums = rx.receive_all(targets, sizes)
            else:
                sums = self.timed(p, rx, sum(sizes), rx.receive_all, targets, sizes)
        except BaseException:
            self.abort_all(slots)
            raise
        out: list[bool | KVStoreError] = []
        for it, res, got, filled in zip(items, slots, results, sums, strict=True):
            if res is None:
                out.append(False if got is None else got)
                continue
            out.append(self.settle(p, res, it, filled, path))
        return out

    def begin_layers(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        layers: int,
        path: str,
    ) -> LayeredWrite:
        """Every item of a layer-by-layer write reserved (Gateway.begin_layers)."""
        self.books.check_batch(len(items))
        if not 0 < layers <= _MAX_LAYERS:
            raise InvalidValue(f"a layer-by-layer write of {layers} layers")
        ns = self.books.namespace(p, model, layout)
        slots, results = self.reserve_all(p, items, ns, lambda info: check_layered(info, layers))
        return LayeredWrite(
            layers,
            [it.nbytes for it in items],
            slots,
            results,
            lambda res, csum: self.commit(p, res, csum, path),
            self.node.abort,
        )

    def write_layers(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        layers: int,
        rx: LayerReceiver,
        path: str,
    ) -> list[bool | KVStoreError | None]:
        """A layer-by-layer write received through ``rx`` (Gateway.write_layers)."""
        write = self.begin_layers(p, model, layout, items, layers, path)
        timed = rx.owner is not None
        try:
            for layer in range(layers):
                for i, n in enumerate(write.per_layer):
                    view = write.target(i, layer)
                    if view is None:
                        rx.skip(n)
                    elif timed:
                        self.timed(p, rx, n, rx.receive, view, n)
                    else:
                        rx.receive(view, n)
            sums = rx.closing_sums(len(items))
        except BaseException:
            write.abort()  # a cut-short stream never becomes visible
            raise
        return write.finish(sums)
