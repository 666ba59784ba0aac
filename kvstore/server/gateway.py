"""The tenant-scoped, limit-checked face of one StoreNode, shared by both front ends.

The gRPC servicer (service.py) and the data-socket server (dataserver.py) decode a
request, authenticate its caller to a Principal and make one call here per request (a
read batch, :meth:`Gateway.read` / :meth:`Gateway.lease`; a write batch,
:meth:`Gateway.write` / :meth:`Gateway.reserve_leased` / :meth:`Gateway.commit_leased`;
or a metadata call); nothing here knows a wire format. That keeps the rules in one place:

- every key is scoped by the caller's tenant (``Principal.scope``) before the node sees
  it, and the namespace checked against block headers is built from the request's model
  and layout plus that tenant, never a tenant named by the request;
- batch size (here) and value size (by the node) are checked before any byte moves;
- shared-memory grants are leases (kvstore/server/leases.py), ended by release, by their data
  connection closing, or by expiry; a write's lease, and a socket put's hold on its
  reservation (:meth:`Gateway.fill_deadline_s`), last only as long as the payload takes
  at the configured floor rate plus a grace, so a stalled payload cannot keep space;
- a tenant with a quota (kvstore/server/quotas.py) has it applied by the node as a Budget
  over its namespaces' fingerprints, kept here in step as it names new namespaces; its
  writes must name a scope (a block without a namespace could not be counted);
- while draining, writes are refused and reads keep working; a clustered server
  also marks its directory record draining (``on_drain``), first, so clients stop
  choosing this node for writes before it starts refusing them;
- the service's half of the counter contract (kvstore/observe/names.py) is kept here:
  bytes per transport path, per-tenant hits, misses and puts; the node never sees a
  tenant, so nothing below this layer can count them.

Methods are blocking (node calls may do SSD I/O) and thread-safe; callers on an event
loop run them in a thread pool. The one coroutine, :meth:`Gateway.set_draining`, runs
on the server's loop (where the directory lives).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.blocks import ValueInfo
from kvstore.config import ServerConfig
from kvstore.errors import (
    ConfigError,
    InvalidValue,
    KVStoreError,
    LimitExceeded,
    QuotaExceeded,
    ReservationError,
    StorageError,
    Unavailable,
)
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.node.budgets import Budget
from kvstore.node.store import BlockRead, Reservation, StoreNode
from kvstore.observe.counters import NodeCounters, split_key
from kvstore.server.layered import LayeredWrite, check_layered
from kvstore.server.leases import Lease, LeaseKind, LeaseTable
from kvstore.server.namespaces import NamespaceRegistry
from kvstore.server.quotas import Quotas
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind

__all__ = ["Filled", "Gateway", "ReadBatch", "ReadItem", "WriteItem"]

# What filling one item's reservation gives back: the xxh3 the writer sent after the
# payload (None: the item's own), and the xxh3 of the bytes as they landed (None: not
# computed, the commit hashes the buffer).
Filled = tuple[int | None, int | None]

# A COMMIT item that binds a credit: (credit lease id, checksum, key, the block's info or
# why it has none)
CreditBind = tuple[int, int, bytes, "ValueInfo | KVStoreError"]

log = logging.getLogger(__name__)

_MAX_LAYERS = 4096  # a layer-by-layer write names its layer count; more is not a model

ReadItem = BlockRead | None | KVStoreError  # a pinned hit, a miss, or that key's failure


class _FixedNamespace(Namespace):
    """A Namespace whose layout and fingerprint are computed once.

    The node asks for ``fingerprint()`` on every key it reads (about 9 us each); the
    gateway builds one of these per (tenant, model, layout) and reuses it.
    """

    __slots__ = ("_fp", "_kl")
    _fp: bytes
    _kl: KVLayout

    def __init__(self, model: str, layout: str, tenant: str) -> None:
        super().__init__(model, layout, tenant)
        object.__setattr__(self, "_kl", KVLayout.parse(layout))
        object.__setattr__(self, "_fp", Namespace.fingerprint(self))

    @property
    def kv_layout(self) -> KVLayout:
        return self._kl

    def fingerprint(self, block_tokens: int | None = None) -> bytes:
        if block_tokens is None:
            return self._fp
        return Namespace.fingerprint(self, block_tokens)


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One item of a write request: the caller's key, its value's description (or why
    it could not be decoded), the writer's xxh3 of the payload and its length."""

    key: bytes
    info: ValueInfo | KVStoreError
    checksum: int
    nbytes: int


class ReadBatch:
    """One read request's pinned blocks (``items``, in key order), and for a same-host
    request the leases granted on some of them (``leases``, by item index). A context
    manager: leaving it unpins what no lease holds and, when its body succeeded, counts
    the request (kvstore/observe/names.py)."""

    __slots__ = ("_gw", "_p", "counted", "items", "leases", "namespace_fp", "path")

    def __init__(
        self, gw: Gateway, p: Principal, items: list[ReadItem], path: str, ns: Namespace | None
    ) -> None:
        self._gw = gw
        self._p = p
        self.items = items
        self.leases: dict[int, Lease] = {}
        self.path = path
        self.counted = False
        self.namespace_fp = b"" if ns is None else ns.fingerprint()

    def __enter__(self) -> ReadBatch:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        gw, leases = self._gw, self.leases
        inline = shm = 0
        for i, r in enumerate(self.items):
            if isinstance(r, BlockRead):
                if i in leases:
                    shm += r.header.payload_len
                else:
                    inline += r.header.payload_len
                    gw.node.close_read(r)
        if exc_type is None:
            if not self.counted:
                gw.count_reads(self._p, self.items)
            gw.count_out(self._p, "shm", shm)
            gw.count_out(self._p, self.path, inline)


class Gateway:
    """Scoped, checked node operations for authenticated principals."""

    def __init__(
        self,
        node: StoreNode,
        config: ServerConfig,
        names: NamespaceRegistry | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.max_value_bytes = node.config.max_value_bytes
        self.leases = LeaseTable(config.lease_ttl_s, self._end_lease, shortest_s=config.put_grace_s)
        self.counters = NodeCounters()
        self.gauges: dict[str, Callable[[], int]] = {}  # live values for stats (connections)
        self.draining = False
        # Tells the cluster directory (kvstore/server/membership.py); None when standalone.
        self.on_drain: Callable[[bool], Awaitable[None]] | None = None
        self._ns: dict[tuple[str, str, str], Namespace] = {}
        self._ns_lock = threading.Lock()
        # Fingerprint -> (tenant, model) of every scope resolved here (and of blocks a
        # drain imported): how admin filters by tenant or model find blocks the node
        # knows by fingerprint. Persisted beside the SSD tier when the server has one.
        self.names = names if names is not None else NamespaceRegistry()
        self.quotas = quotas if quotas is not None else Quotas()
        self._budgets: dict[str, Budget] = {}  # tenant -> the Budget the node applies
        self._budget_lock = threading.Lock()
        for q in self.quotas:  # namespaces known from earlier runs count at once
            self._budgets[q.tenant] = q.budget(self.names.select(q.tenant))
            self.node.set_budget(self._budgets[q.tenant])

    def close(self) -> None:
        """End every lease (pins and reservations go back to the node); close the
        namespace registry."""
        self.leases.close()
        self.names.close()

    # -- checks ------------------------------------------------------------------------

    def check_batch(self, n: int) -> None:
        """Refuse a request naming more keys than ``max_batch``."""
        if n > self.config.max_batch:
            raise LimitExceeded(f"{n} keys in one request; max_batch is {self.config.max_batch}")

    def namespace(self, p: Principal, model: str, layout: str) -> Namespace | None:
        """The caller's namespace: the request's model and layout, the token's tenant."""
        if not model and not layout:
            return None
        key = (p.tenant, model, layout)
        ns = self._ns.get(key)
        if ns is None:
            try:
                ns = _FixedNamespace(model, layout, p.tenant)
            except ConfigError as exc:
                raise InvalidValue(f"bad scope: {exc}") from None
            limit = self.config.max_namespaces_per_tenant
            self.names.add(ns.fingerprint(), p.tenant, model, limit=limit)  # no-op once known
            self._cover(p.tenant, ns.fingerprint())
            with self._ns_lock:
                if len(self._ns) > 4096:
                    self._ns.clear()
                self._ns[key] = ns
        return ns

    def _cover(self, tenant: str, fp: bytes) -> None:
        """Bring a namespace under its tenant's quota (a no-op without one, or once in)."""
        q = self.quotas.get(tenant)
        if q is None:
            return
        with self._budget_lock:
            old = self._budgets.get(tenant)
            if old is not None and fp in old.namespaces:
                return
            budget = q.budget((old.namespaces if old is not None else frozenset()) | {fp})
            self.node.set_budget(budget)
            self._budgets[tenant] = budget

    def fill_deadline_s(self, nbytes: int) -> float:
        """How long a write may hold a reservation while ``nbytes`` of payload arrive:
        the grace plus the time they take at the floor rate."""
        c = self.config
        return c.put_grace_s + nbytes / c.put_floor_bytes

    # -- accounting (the service's counters, kvstore/observe/names.py) --------------------

    def count_reads(self, p: Principal, reads: Sequence[ReadItem]) -> None:
        """Per-tenant hits (by the tier the read found) and misses of one request."""
        tally: dict[str, int] = {}
        for r in reads:
            if isinstance(r, BlockRead):
                name = f"hits_{(r.hit or r.tier).value}"
            elif r is None:
                name = "misses"
            else:
                continue  # a failed key is neither
            tally[name] = tally.get(name, 0) + 1
        for name, n in tally.items():
            self.counters.inc(name, n, tenant=p.tenant)

    def touch(
        self, p: Principal, keys: Sequence[bytes], nbytes: int, seconds: Sequence[float] = ()
    ) -> None:
        """Account reads a same-host client served itself from the published DRAM
        index (kvstore/shm/index.py): DRAM hits, bytes out over shm, recency, and the
        latency of each call (``seconds``).

        The figures are the client's word: a byte count beyond what ``keys`` can hold
        (each at most max_value_bytes) and latencies that are not a number of seconds
        within an hour, or more of them than keys, are cut to what is possible, so a
        hostile or broken client can skew its own counts but never overflow one."""
        self.check_batch(len(keys))
        self.node.touch(p.scope_all(keys))
        self.counters.inc("hits_dram", len(keys), tenant=p.tenant)
        self.count_out(p, "shm", min(max(nbytes, 0), len(keys) * self.max_value_bytes))
        for s in seconds[: len(keys)]:
            if 0.0 <= s <= 3600.0:  # NaN fails both
                self.counters.observe("get", "shm", s)

    def count_out(self, p: Principal, path: str, nbytes: int) -> None:
        """Payload bytes handed to a reader over ``path`` (shm, tcp, grpc)."""
        if nbytes:
            self.counters.inc(f"bytes_out_{path}", nbytes)
            self.counters.inc(f"bytes_out_{path}", nbytes, tenant=p.tenant)

    def count_put(self, p: Principal, path: str, nbytes: int) -> None:
        """A committed put of ``nbytes`` payload bytes over ``path``."""
        c, t = self.counters, p.tenant
        c.inc(f"bytes_in_{path}", nbytes)
        c.inc(f"bytes_in_{path}", nbytes, tenant=t)
        c.inc("puts", tenant=t)
        c.inc("bytes_in", nbytes, tenant=t)

    def _writable(self) -> None:
        if self.draining:
            raise Unavailable("server is draining: writes are refused, reads still work")

    # -- metadata ----------------------------------------------------------------------

    def exists(self, p: Principal, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of the caller's keys is stored."""
        self.check_batch(len(keys))
        return self.node.exists(p.scope_all(keys))

    def match_prefix(self, p: Principal, keys: Sequence[bytes]) -> int:
        """How many of the caller's leading keys are stored."""
        self.check_batch(len(keys))
        return self.node.match_prefix(p.scope_all(keys))

    def lookup(self, p: Principal, keys: Sequence[bytes]) -> list[str]:
        """The tier of each key ("" when absent)."""
        self.check_batch(len(keys))
        tiers = [self.node.tier_of(k) for k in p.scope_all(keys)]
        return [t.value if t is not None else "" for t in tiers]

    def remove(self, p: Principal, keys: Sequence[bytes]) -> int:
        """Remove the caller's blocks; how many were present."""
        self.check_batch(len(keys))
        return self.node.remove(p.scope_all(keys))

    # -- reads -------------------------------------------------------------------------

    def read(
        self, p: Principal, model: str, layout: str, keys: Sequence[bytes], *, path: str = "tcp"
    ) -> ReadBatch:
        """One read request: pin each of the caller's keys (None on a miss, the error for
        a failed key) in the caller's namespace. Use the result as a context manager:
        leaving it unpins them and, when its body succeeded (the reply is on its way;
        accounting is not what the reader waits for), counts the hits, misses and the
        hits' payload bytes on ``path``."""
        self.check_batch(len(keys))
        ns = self.namespace(p, model, layout)
        return ReadBatch(self, p, self._open(p, keys, ns), path, ns)

    def lease(
        self, p: Principal, model: str, layout: str, keys: Sequence[bytes], owner: int
    ) -> ReadBatch:
        """One same-host read request: like :meth:`read`, but every hit a same-host
        client may copy from the shared segment is handed over under a read lease
        (``ReadBatch.leases``) and stays pinned until the lease ends; the other hits go
        inline over the socket (path ``tcp``), and leased bytes count as path ``shm``."""
        self.check_batch(len(keys))
        ns = self.namespace(p, model, layout)
        batch = ReadBatch(self, p, self._open(p, keys, ns), "tcp", ns)
        try:
            for i, r in enumerate(batch.items):
                if isinstance(r, BlockRead) and r.shm_offset >= 0:
                    batch.leases[i] = self.leases.grant(LeaseKind.READ, r, p.tenant, owner)
        except BaseException:
            batch.__exit__(None, None, None)
            raise
        self.count_reads(p, batch.items)  # leased hits are counted when granted
        batch.counted = True
        return batch

    def _open(self, p: Principal, keys: Sequence[bytes], ns: Namespace | None) -> list[ReadItem]:
        out: list[ReadItem] = []
        try:
            for k in p.scope_all(keys):
                try:
                    out.append(self.node.open_read(k, namespace=ns))
                except KVStoreError as exc:
                    out.append(exc)
        except BaseException:
            for r in out:
                if isinstance(r, BlockRead):
                    self.node.close_read(r)
            raise
        return out

    def release_reads(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """End read leases; returns (released, expired or unknown)."""
        return self._end_leases(p, lease_ids, LeaseKind.READ, self.node.close_read)

    # -- writes ------------------------------------------------------------------------

    def write(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        fill: Callable[[Any, int], Filled],
        path: str = "tcp",
    ) -> list[bool | KVStoreError]:
        """One write request, item by item, in order: reserve the caller's key, have
        ``fill(buffer, nbytes)`` put the item's bytes into the reservation's host buffer
        (``fill(None, nbytes)``: the item is refused or stored already, skip its bytes),
        commit against the writer's xxh3: the item's, or the one ``fill`` returns (a
        writer that sends each checksum after its payload). ``fill`` returns that xxh3
        (or None) and the xxh3 of the bytes as they landed, when it computed one (or
        None: the commit hashes the buffer). Each item reports True
        (stored), False (stored already) or its error. A failing ``fill`` aborts its
        reservation and ends the request; the batch-size and scope checks fail it
        before any fill."""
        self.check_batch(len(items))
        ns = self.namespace(p, model, layout)
        out: list[bool | KVStoreError] = []
        for it in items:
            try:
                if isinstance(it.info, KVStoreError):
                    raise it.info
                res = self._reserve(p, it.key, it.info, ns)
            except KVStoreError as exc:
                out.append(self._refused(p, exc))  # counted before its bytes are read past
                fill(None, it.nbytes)
                continue
            if res is None:
                fill(None, it.nbytes)
                out.append(False)
                continue
            try:
                sent_sum, landed = fill(res.payload, it.nbytes)
            except BaseException:
                self.node.abort(res)  # a cut-short payload never becomes visible
                raise
            out.append(self._commit_item(p, res, it, sent_sum, path, landed))
        return out

    def write_at_once(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        receive: Callable[[list[Any]], list[Filled]],
        path: str = "ucx",
    ) -> list[bool | KVStoreError]:
        """One write request whose payloads are received together: every item reserved
        first, then ``receive(buffers)`` fills every reservation's host buffer (None:
        refused or stored already, its bytes skipped) and returns, for each item, what
        :meth:`write`'s ``fill`` returns; then each item is committed.
        :meth:`write` takes the items one by one; this is for a transport that gains
        from having every receive posted at once (UCX, UcxFrames.recv_many), at the
        price of holding the whole batch's space until its last byte is in. A failing
        ``receive`` aborts every reservation."""
        self.check_batch(len(items))
        ns = self.namespace(p, model, layout)
        slots, results = self._reserve_all(p, items, ns)
        try:
            sums = receive([None if r is None else r.payload for r in slots])
        except BaseException:
            for held in slots:
                if held is not None:
                    self.node.abort(held)
            raise
        out: list[bool | KVStoreError] = []
        for it, res, got, (sent_sum, landed) in zip(items, slots, results, sums, strict=True):
            if res is None:
                out.append(False if got is None else got)
                continue
            out.append(self._commit_item(p, res, it, sent_sum, path, landed))
        return out

    def _commit_item(
        self,
        p: Principal,
        res: Reservation,
        it: WriteItem,
        sent_sum: int | None,
        path: str,
        landed: int | None,
    ) -> bool | KVStoreError:
        """Commit one filled item against the writer's xxh3 (the item's, or the one sent
        after its payload), with ``landed`` the xxh3 its receiver computed as the bytes
        arrived (StoreNode.commit): True, False (stored already) or its error."""
        checksum = it.checksum if sent_sum is None else sent_sum
        try:
            return self._commit(p, res, checksum, path, landed)
        except KVStoreError as exc:
            return exc

    def _reserve_all(
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
                    if isinstance(it.info, KVStoreError):
                        raise it.info
                    if check is not None:
                        check(it.info)
                    res = self._reserve(p, it.key, it.info, ns)
                    results.append(None if res is not None else False)
                except KVStoreError as exc:
                    results.append(self._refused(p, exc))
                slots.append(res)
        except BaseException:
            for held in slots:
                if held is not None:
                    self.node.abort(held)
            raise
        return slots, results

    def begin_layers(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        layers: int,
        path: str = "tcp",
    ) -> LayeredWrite:
        """One layer-by-layer write request (kvstore/server/layered.py): every item
        reserved now, filled by the caller one layer at a time, committed by
        :meth:`LayeredWrite.finish`. The caller must :meth:`LayeredWrite.abort` when
        the stream ends early, or the reservations stay until the process ends."""
        self.check_batch(len(items))
        if not 0 < layers <= _MAX_LAYERS:
            raise InvalidValue(f"a layer-by-layer write of {layers} layers")
        ns = self.namespace(p, model, layout)
        slots, results = self._reserve_all(p, items, ns, lambda info: check_layered(info, layers))
        return LayeredWrite(
            layers,
            [it.nbytes for it in items],
            slots,
            results,
            lambda res, csum: self._commit(p, res, csum, path),
            self.node.abort,
        )

    def reserve_leased(
        self, p: Principal, model: str, layout: str, items: Sequence[WriteItem], owner: int
    ) -> list[Lease | KVStoreError | None]:
        """One same-host write request, phase one: a write lease on a reservation in the
        shared segment for each item (None when stored already, or that item's error)."""
        self.check_batch(len(items))
        ns = self.namespace(p, model, layout)
        # the client copies the whole batch, then commits it: one deadline for all
        ttl = min(self.fill_deadline_s(sum(it.nbytes for it in items)), self.config.lease_ttl_s)
        out: list[Lease | KVStoreError | None] = []
        for it in items:
            try:
                if isinstance(it.info, KVStoreError):
                    raise it.info
                res = self._reserve(p, it.key, it.info, ns)
                if res is not None and res.shm_offset < 0:
                    self.node.abort(res)
                    raise StorageError(
                        "shared-memory writes need a DRAM top tier; use the data socket"
                    )
            except KVStoreError as exc:
                out.append(self._refused(p, exc))
                continue
            out.append(
                None
                if res is None
                else self.leases.grant(LeaseKind.WRITE, res, p.tenant, owner, ttl_s=ttl)
            )
        return out

    def commit_leased(
        self,
        p: Principal,
        items: Sequence[tuple[int, int] | CreditBind],
        model: str = "",
        layout: str = "",
    ) -> list[bool | KVStoreError]:
        """Phase two for (lease id, checksum) pairs: True stored, False stored already,
        or the item's error (an expired or unknown lease is a ReservationError). An item
        of four, (credit lease id, checksum, key, info), first names the block its
        credit holds (:meth:`grant_credits`), in the namespace of ``model`` and
        ``layout``; a block that does not fit its credit fails and frees it."""
        self.check_batch(len(items))
        binds = any(len(it) == 4 for it in items)
        ns = self.namespace(p, model, layout) if binds else None
        out: list[bool | KVStoreError] = []
        for item in items:
            lease_id, checksum = item[0], item[1]
            kind = LeaseKind.CREDIT if len(item) == 4 else LeaseKind.WRITE
            lease = self.leases.take(lease_id, p.tenant, kind)
            if lease is None:
                out.append(ReservationError("reservation lease expired or unknown; write it again"))
                continue
            res = lease.obj
            try:
                if len(item) == 4:
                    key, info = item[2], item[3]
                    try:
                        if isinstance(info, KVStoreError):
                            raise info
                        res = self.node.bind(res, p.scope(key), info, namespace=ns)
                    except KVStoreError:
                        self.node.abort(res)
                        raise
                out.append(self._commit(p, res, checksum, "shm"))
            except KVStoreError as exc:
                out.append(exc)
        return out

    def grant_credits(
        self,
        p: Principal,
        model: str,
        layout: str,
        sizes: Sequence[int],
        owner: int,
    ) -> list[Lease]:
        """Write credits for a same-host writer's next puts: for each size, an extent
        of the shared segment reserved for a block of that many bytes in this scope,
        whose key the COMMIT that stores it names (:meth:`commit_leased`). Each is a
        write lease of ``lease_ttl_s``: unused, it expires and frees its space. Granting
        stops at the first size that cannot be had (no room, the tenant's quota): a
        credit is an optimisation, the writer reserves as before without one."""
        if not sizes:
            return []
        ns = self.namespace(p, model, layout)
        out: list[Lease] = []
        for n in sizes:
            try:
                self._check_writer(p, ns)
                res = self.node.reserve_credit(n, namespace=ns)
            except KVStoreError as exc:
                self._refused(p, exc)
                break
            if res.shm_offset < 0:  # no shared segment: nothing to lend
                self.node.abort(res)
                break
            ttl = self.config.lease_ttl_s
            out.append(self.leases.grant(LeaseKind.CREDIT, res, p.tenant, owner, ttl_s=ttl))
        return out

    def abort_leased(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """Abort same-host writes; returns (aborted, expired or unknown)."""
        done, left = self._end_leases(p, lease_ids, LeaseKind.WRITE, self.node.abort)
        if left:  # credits are aborted the same way
            more, _ = self._end_leases(p, lease_ids, LeaseKind.CREDIT, self.node.abort)
            done, left = done + more, left - more
        return done, left

    def _end_leases(
        self, p: Principal, lease_ids: Sequence[int], kind: LeaseKind, end: Callable[[Any], Any]
    ) -> tuple[int, int]:
        """End the caller's own leases of ``kind`` with ``end``; (ended, expired or unknown)."""
        n = 0
        for lid in lease_ids:
            lease = self.leases.take(lid, p.tenant, kind)
            if lease is not None:
                end(lease.obj)
                n += 1
        return n, len(lease_ids) - n

    def _reserve(
        self, p: Principal, key: bytes, info: ValueInfo, ns: Namespace | None
    ) -> Reservation | None:
        self._check_writer(p, ns)
        # it checks size, layout and the tenant's quota (kvstore/node/budgets.py)
        return self.node.reserve(p.scope(key), info, namespace=ns)

    def _check_writer(self, p: Principal, ns: Namespace | None) -> None:
        """Refuse a write this node does not take now, or one a quota could not count."""
        self._writable()
        if ns is None and p.tenant in self._budgets:
            raise InvalidValue(
                f"tenant {p.tenant!r} has a quota: its writes must name a model and layout "
                "(a scope), or they could not be counted"
            )

    def _refused(self, p: Principal, exc: KVStoreError) -> KVStoreError:
        if isinstance(exc, QuotaExceeded):
            self.counters.inc("quota_refusals")
            self.counters.inc("quota_refusals", tenant=p.tenant)
        return exc

    def _commit(
        self, p: Principal, res: Reservation, checksum: int, path: str, landed: int | None = None
    ) -> bool:
        try:
            stored = self.node.commit(res, expected_checksum=checksum, landed_checksum=landed)
        except KVStoreError:
            self.counters.inc("rejected_commits")
            raise
        if stored:
            self.count_put(p, path, res.info.nbytes)
        return stored

    def _end_lease(self, lease: Lease) -> None:
        if lease.kind is LeaseKind.READ:
            self.node.close_read(lease.obj)
        elif lease.kind is LeaseKind.WRITE or lease.kind is LeaseKind.CREDIT:
            self.node.abort(lease.obj)
        else:  # FILL: cut the stalled connection; its thread aborts the reservation
            self.counters.inc("puts_stalled")
            self.counters.inc("puts_stalled", tenant=lease.tenant)
            lease.obj()

    # -- admin -------------------------------------------------------------------------

    def stats(self, p: Principal) -> tuple[dict[str, Any], dict[str, int]]:
        """Node stats and server counters (any authenticated caller: no keys in them).

        Per-tenant counters name tenants, so a non-admin caller sees only its own."""
        server = self.counters.snapshot()
        if not p.admin:
            server = {k: v for k, v in server.items() if split_key(k)[1] in (None, p.tenant)}
        server.update({name: fn() for name, fn in self.gauges.items()})
        server.update(self._quota_usage(p))
        credits = self.leases.count(LeaseKind.CREDIT)
        server["leases"] = len(self.leases) - credits
        server["credits_lent"] = credits
        server["leases_expired"] = self.leases.expired
        server["draining"] = int(self.draining)
        return self.node.stats(), server

    def _quota_usage(self, p: Principal) -> dict[str, int]:
        """Per tenant with a quota (all for an admin, else the caller's own): bytes held
        per tier (``quota_used_<tier>@<tenant>``) and writes in flight."""
        with self._budget_lock:
            budgets = [(t, b) for t, b in self._budgets.items() if p.admin or t == p.tenant]
        out: dict[str, int] = {}
        for tenant, b in budgets:
            usage = self.node.usage(b)
            for kind, nbytes in usage.tier_bytes.items():
                out[f"quota_used_{kind.value}@{tenant}"] = nbytes
            out[f"quota_inflight@{tenant}"] = usage.reservations
            out[f"quota_inflight_bytes@{tenant}"] = usage.reserved_bytes
        return out

    def tier(self, name: str) -> TierKind:
        """This node's tier called ``name``; InvalidValue naming the tiers it has."""
        try:
            kind = TierKind(name)
        except ValueError:
            kind = None
        if kind is None or kind not in self.node.tiers:
            have = ", ".join(t.value for t in self.node.tiers)
            raise InvalidValue(f"this node has no {name!r} tier (it has {have})")
        return kind

    async def set_draining(self, p: Principal, draining: bool) -> bool:
        """Admin: refuse (or accept again) new writes, and tell the cluster directory.

        Going into a drain the directory record changes first, so clients move their
        writes elsewhere before this node refuses them; leaving one, writes are taken
        again before the record says so. The local state always follows the request:
        when the directory cannot be written the error is raised after it changed, and
        the directory catches up on its own (the registration keeps the state)."""
        p.require_admin("drain")
        hook = self.on_drain
        try:
            if draining and hook is not None:
                await hook(True)
        finally:
            self.set_local_draining(p, draining)
        if not draining and hook is not None:
            await hook(False)
        return self.draining

    def set_local_draining(self, p: Principal, draining: bool) -> bool:
        """Admin: refuse (or accept again) new writes on this node only."""
        p.require_admin("drain")
        self.draining = draining
        log.info("draining %s", "on" if draining else "off")
        return self.draining
