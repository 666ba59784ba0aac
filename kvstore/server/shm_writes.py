"""The gateway's same-host writes: reservations in the shared segment, lent under
leases to a client that copies the bytes in itself, committed by a later request.

Two ways in. RESERVE names the items and gets a write lease on a reservation for each;
write credits (``PutRequest.credits``) are reservations granted ahead of any key, for a
writer's next puts, whose COMMIT then names the block each holds (a :class:`CreditBind`).
Either way COMMIT verifies and commits, ABORT, expiry or the data connection closing
releases.

Where they land: in the node's shared DRAM segment, the only memory a same-host client
can map, also when the node's top tier is HBM. There the block is committed and stays:
the client's checksum is verified against the host bytes it wrote, and DRAM is where
the same host's readers copy from without a round trip (an HBM block would go to them
inline over the socket). So a same-host put to an HBM node succeeds with the client's
default transport, and nothing the client does changes; only a node that shares no
memory at all (a private DRAM tier) refuses, and its clients use the data socket
(they are told at HELLO: no segment).

How many credits a connection may hold is decided here too: at most ``_CREDIT_BYTES``
of them live at a time, and at most ``1 / _CREDIT_SHARE`` of the DRAM tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvstore.blocks import ValueInfo
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError, ReservationError, StorageError
from kvstore.node.store import Reservation, StoreNode
from kvstore.server.books import Books
from kvstore.server.leases import Lease, LeaseKind, LeaseTable
from kvstore.server.write_batch import WriteItem, Writes
from kvstore.tenants import Principal

__all__ = ["CommitItem", "CreditBind", "ShmWrites"]

# Write credits one connection may hold at a time (PutRequest.credits): at most this
# many bytes, and at most this share of the DRAM tier.
_CREDIT_BYTES = 64 << 20
_CREDIT_SHARE = 8


class CommitItem(NamedTuple):
    """A COMMIT item for a reserved write: its write lease and the writer's xxh3."""

    lease_id: int
    checksum: int


class CreditBind(NamedTuple):
    """A COMMIT item that binds a credit: the block its credit lease now holds."""

    lease_id: int
    checksum: int
    key: bytes
    info: ValueInfo | KVStoreError  # the block's description, or why it has none


class ShmWrites:
    """Same-host write requests: write leases, credits, their commits and aborts."""

    def __init__(
        self,
        node: StoreNode,
        books: Books,
        leases: LeaseTable,
        writes: Writes,
        config: ServerConfig,
    ) -> None:
        self.node, self.books, self.leases = node, books, leases
        self.writes, self.config = writes, config
        # live credits by connection: owner -> credit lease id -> bytes. Each entry is
        # only touched by its own connection's thread.
        self._lent: dict[int, dict[int, int]] = {}
        self._credit_cap = -1  # bytes of credits one connection may hold (at the first ask)

    def reserve(
        self, p: Principal, model: str, layout: str, items: Sequence[WriteItem], owner: int
    ) -> list[Lease | KVStoreError | None]:
        """Phase one (Gateway.reserve_leased)."""
        books = self.books
        books.check_batch(len(items))
        ns = books.namespace(p, model, layout)
        # the client copies the whole batch, then commits it: one deadline for all
        ttl = min(
            self.writes.fill_deadline_s(sum(it.nbytes for it in items)), self.config.lease_ttl_s
        )
        out: list[Lease | KVStoreError | None] = []
        for it in items:
            try:
                res = self.writes.reserve(p, it, ns, shared=True)
                if res is not None and res.shm_offset < 0:  # a tier that is not mapped
                    self.node.abort(res)
                    raise StorageError("this node shares no memory; use the data socket")
            except KVStoreError as exc:
                out.append(books.refused(p, exc))
                continue
            out.append(
                None
                if res is None
                else self.leases.grant(LeaseKind.WRITE, res, p.tenant, owner, ttl_s=ttl)
            )
        return out

    def commit(
        self,
        p: Principal,
        items: Sequence[CommitItem | CreditBind],
        model: str,
        layout: str,
        owner: int,
    ) -> list[bool | KVStoreError]:
        """Phase two (Gateway.commit_leased)."""
        self.books.check_batch(len(items))
        binds = any(isinstance(it, CreditBind) for it in items)
        ns = self.books.namespace(p, model, layout) if binds else None
        lent = self._lent.get(owner)
        out: list[bool | KVStoreError] = []
        for item in items:
            bind = isinstance(item, CreditBind)
            if bind and lent is not None:
                lent.pop(item.lease_id, None)
            kind = LeaseKind.CREDIT if bind else LeaseKind.WRITE
            lease = self.leases.take(item.lease_id, p.tenant, kind)
            if lease is None:
                out.append(ReservationError("reservation lease expired or unknown; write it again"))
                continue
            res: Reservation = lease.obj
            try:
                if isinstance(item, CreditBind):
                    try:
                        if isinstance(item.info, KVStoreError):
                            raise item.info
                        res = self.node.bind(res, p.scope(item.key), item.info, namespace=ns)
                    except KVStoreError:
                        self.node.abort(res)
                        raise
                out.append(self.writes.commit(p, res, item.checksum, "shm"))
            except KVStoreError as exc:
                out.append(exc)
        return out

    def lend_credits(
        self, p: Principal, model: str, layout: str, sizes: Sequence[int], owner: int
    ) -> list[Lease]:
        """Credits for a connection's next puts (Gateway.lend_credits)."""
        sizes = sizes[: self.config.max_batch]
        if not sizes:
            return []
        if self._credit_cap < 0:
            dram = self.node.stats()["tiers"].get("dram", {}).get("capacity", 0)
            self._credit_cap = min(_CREDIT_BYTES, int(dram) // _CREDIT_SHARE)
        leases = self.leases
        held = {lid: n for lid, n in self._lent.get(owner, {}).items() if leases.holds(lid)}
        self._lent[owner] = held
        room = self._credit_cap - sum(held.values())
        take: list[int] = []
        for n in sizes:
            if n > room:
                break
            take.append(n)
            room -= n
        granted = self._grant_credits(p, model, layout, take, owner)
        for lease in granted:
            held[lease.id] = lease.obj.info.nbytes
        return granted

    def _grant_credits(
        self, p: Principal, model: str, layout: str, sizes: Sequence[int], owner: int
    ) -> list[Lease]:
        """A write lease of ``lease_ttl_s`` on a keyless reservation per size, stopping
        at the first that cannot be had (no room, the tenant's quota)."""
        if not sizes:
            return []
        ns = self.books.namespace(p, model, layout)
        out: list[Lease] = []
        for n in sizes:
            try:
                self.books.check_writer(p, ns)
                res = self.node.reserve_credit(n, namespace=ns, shared=True)
            except KVStoreError as exc:
                self.books.refused(p, exc)
                break
            if res.shm_offset < 0:  # no shared segment: nothing to lend
                self.node.abort(res)
                break
            ttl = self.config.lease_ttl_s
            out.append(self.leases.grant(LeaseKind.CREDIT, res, p.tenant, owner, ttl_s=ttl))
        return out

    def abort(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """Abort same-host writes, credits included; (aborted, expired or unknown)."""
        done = 0
        left: list[int] = []
        for lid in lease_ids:
            lease = self.leases.take(lid, p.tenant, LeaseKind.WRITE)
            if lease is None:
                left.append(lid)
            else:
                self.node.abort(lease.obj)
                done += 1
        if left:  # credits are aborted the same way
            for lid in left:
                lease = self.leases.take(lid, p.tenant, LeaseKind.CREDIT)
                if lease is not None:
                    self.node.abort(lease.obj)
                    done += 1
        return done, len(lease_ids) - done

    def forget(self, owner: int) -> None:
        """Drop a closed connection's credit book (its leases end with it)."""
        self._lent.pop(owner, None)
