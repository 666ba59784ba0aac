"""The tenant-scoped, limit-checked face of one StoreNode, shared by both front ends.

The gRPC servicer (service.py) and the data-socket session (session.py) decode a
request, authenticate its caller to a Principal and make one call here per request;
nothing here knows a wire format, and nothing above here talks to the node. The
gateway owns admission (batch size, scope, quotas, draining: kvstore/server/books.py),
the leases it lends (kvstore/server/leases.py) and the write credits, and delegates to
its batches: reads (kvstore/server/read_batch.py), writes through the data socket or in
process (kvstore/server/write_batch.py) and same-host writes into the shared segment
(kvstore/server/shm_writes.py).

The write story
---------------
Every write, whichever way its bytes come, is one story::

    reserve -> fill -> verify -> commit
                  \\-> abort (a refusal, a cut-short fill, an expiry, a withdrawal)

- **reserve**: the item's key is scoped by the caller's tenant, its namespace built from
  the request's model and layout plus that tenant; the books admit it (batch size, a
  scope where a quota needs one, not draining) and the node reserves space (value size,
  layout, the tenant's quota) or answers "stored already". Nothing is visible yet.
- **fill**: the payload lands straight in the reservation: a
  :class:`~kvstore.server.write_batch.PayloadReceiver` is asked for it (socket, UCX, in
  process), or a same-host client copies it into the shared segment under a lease.
  A fill from a connection holds its reservation only while its bytes keep coming:
  under a FILL lease of ``put_grace_s + nbytes / put_floor_bytes``
  (:meth:`Gateway.fill_deadline_s`), past which the reaper cuts the connection.
- **verify**: the commit checks the writer's xxh3 (the item's, the one sent after the
  payload, or the one computed as the bytes landed) against the bytes.
- **commit** makes the block visible and counts the put; **abort** releases the space,
  so a half-written block is never seen.

The six write paths are cases of it:

1. ``write`` (socket PUT, item by item): reserve, fill, verify, commit one item after
   the other; a refused item's bytes are skipped; a fill that fails aborts its item and
   ends the request.
2. ``write`` with an ``at_once`` receiver (UCX PUT of several items): reserve all, fill
   all in one receive, verify and commit each; a failed receive aborts all.
3. layer-by-layer (``write_layers`` for the socket, ``begin_layers`` in process): reserve
   all, fill each item one layer run at a time, then verify and commit the kept items
   and abort the withdrawn ones; a stream that ends early aborts all.
4. reserve/commit (``reserve_leased`` then ``commit_leased``, same host): reserve under
   a WRITE lease, the client fills the shared segment, COMMIT verifies and commits;
   ABORT, expiry or the connection closing aborts.
5. credits (``lend_credits`` then ``commit_leased`` with a CreditBind): reserve ahead of
   any key under a CREDIT lease, the client fills it, COMMIT names the block (bind),
   verifies and commits; an unused credit expires and aborts.
6. layered shared memory: case 4 whose client fills each layer run as it is produced
   before one COMMIT.

Reads are pinned (:meth:`Gateway.read`), or leased to a same-host client
(:meth:`Gateway.lease`); every lease ends by release, by its data connection closing
(:meth:`Gateway.end_connection`) or by expiry. While draining, writes are refused and
reads keep working; a clustered server also marks its directory record draining
(``on_drain``), first, so clients stop choosing this node for writes before it starts
refusing them.

Methods are blocking (node calls may do SSD I/O) and thread-safe; callers on an event
loop run them in a thread pool. The one coroutine, :meth:`Gateway.set_draining`, runs
on the server's loop (where the directory lives).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvstore.config import ServerConfig
from kvstore.errors import InvalidValue, KVStoreError
from kvstore.node.store import StoreNode
from kvstore.observe.counters import split_key
from kvstore.server.books import Books
from kvstore.server.layered import LayeredWrite
from kvstore.server.leases import Lease, LeaseKind, LeaseTable
from kvstore.server.namespaces import NamespaceRegistry
from kvstore.server.quotas import Quotas
from kvstore.server.read_batch import ReadBatch, Reads
from kvstore.server.shm_writes import CommitItem, CreditBind, ShmWrites
from kvstore.server.write_batch import LayerReceiver, PayloadReceiver, WriteItem, Writes
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind

__all__ = ["Gateway"]

log = logging.getLogger(__name__)


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
        # Fingerprint -> (tenant, model) of every scope resolved here (and of blocks a
        # drain imported): how admin filters by tenant or model find blocks the node
        # knows by fingerprint. Persisted beside the SSD tier when the server has one.
        self.books = Books(
            node,
            config,
            names if names is not None else NamespaceRegistry(),
            quotas if quotas is not None else Quotas(),
        )
        self.leases = LeaseTable(config.lease_ttl_s, self._end_lease, shortest_s=config.put_grace_s)
        self.gauges: dict[str, Callable[[], int]] = {}  # live values for stats (connections)
        # Tells the cluster directory (kvstore/server/membership.py); None when standalone.
        self.on_drain: Callable[[bool], Awaitable[None]] | None = None
        self._reads = Reads(node, self.books, self.leases)
        self._writes = Writes(node, self.books, self.leases, config)
        self._shm = ShmWrites(node, self.books, self.leases, self._writes, config)

    def close(self) -> None:
        """End every lease (pins and reservations go back to the node); close the
        namespace registry."""
        self.leases.close()
        self.books.names.close()

    @property
    def draining(self) -> bool:
        return self.books.draining

    @property
    def shm_name(self) -> str:
        """The node's shared segment a same-host client maps ("" without one)."""
        return self.node.shm_name or ""

    def check_batch(self, n: int) -> None:
        """Refuse a request naming more keys than ``max_batch``."""
        self.books.check_batch(n)

    def fill_deadline_s(self, nbytes: int) -> float:
        """How long a write may hold a reservation while ``nbytes`` of payload arrive."""
        return self._writes.fill_deadline_s(nbytes)

    def end_connection(self, owner: int) -> int:
        """A data connection closed: end every lease granted on it and forget its
        credits; returns how many leases ended."""
        self._shm.forget(owner)
        return self.leases.end_owner(owner)

    # -- metadata ----------------------------------------------------------------------

    def exists(self, p: Principal, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of the caller's keys is stored."""
        self.books.check_batch(len(keys))
        return self.node.exists(p.scope_all(keys))

    def match_prefix(self, p: Principal, keys: Sequence[bytes]) -> int:
        """How many of the caller's leading keys are stored."""
        self.books.check_batch(len(keys))
        return self.node.match_prefix(p.scope_all(keys))

    def lookup(self, p: Principal, keys: Sequence[bytes]) -> list[str]:
        """The tier of each key ("" when absent)."""
        self.books.check_batch(len(keys))
        tiers = [self.node.tier_of(k) for k in p.scope_all(keys)]
        return [t.value if t is not None else "" for t in tiers]

    def remove(self, p: Principal, keys: Sequence[bytes]) -> int:
        """Remove the caller's blocks; how many were present."""
        self.books.check_batch(len(keys))
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
        return self._reads.read(p, model, layout, keys, path)

    def lease(
        self, p: Principal, model: str, layout: str, keys: Sequence[bytes], owner: int
    ) -> ReadBatch:
        """One same-host read request: like :meth:`read`, but every hit a same-host
        client may copy from the shared segment is handed over under a read lease
        (``ReadBatch.leases``) and stays pinned until the lease ends; the other hits go
        inline over the socket (path ``tcp``), and leased bytes count as path ``shm``."""
        return self._reads.lease(p, model, layout, keys, owner)

    def release_reads(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """End read leases; returns (released, expired or unknown)."""
        return self._reads.release(p, lease_ids)

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
        self._reads.touch(p, keys, nbytes, seconds)

    # -- writes (the story above) ------------------------------------------------------

    def write(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        rx: PayloadReceiver,
        path: str = "tcp",
    ) -> list[bool | KVStoreError]:
        """One write request, paths 1 and 2: each item of the caller's is reserved and
        ``rx`` asked for its payload (or to skip it: refused, or stored already), then
        committed against the writer's xxh3 (the item's, or the one ``rx`` returns).
        An ``at_once`` receiver of several items gets every payload in one call after
        every item is reserved. Each item reports True (stored), False (stored
        already) or its error. A failing receive aborts what it was filling and ends
        the request; the batch-size and scope checks fail it before any receive."""
        return self._writes.write(p, model, layout, items, rx, path)

    def write_layers(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        layers: int,
        rx: LayerReceiver,
        path: str = "tcp",
    ) -> list[bool | KVStoreError | None]:
        """One layer-by-layer write request (path 3) whose payloads ``rx`` receives:
        every item reserved, then layer 0 of each item, layer 1 of each, ..., then each
        item's checksum and keep flag, then one commit (True, False, None withdrawn,
        or its error). A receive that fails aborts every reservation."""
        return self._writes.write_layers(p, model, layout, items, layers, rx, path)

    def begin_layers(
        self,
        p: Principal,
        model: str,
        layout: str,
        items: Sequence[WriteItem],
        layers: int,
        path: str = "tcp",
    ) -> LayeredWrite:
        """Path 3 for a caller that pushes the layers itself (kvstore/server/layered.py):
        every item reserved now, filled one layer at a time, committed by
        :meth:`LayeredWrite.finish`. The caller must :meth:`LayeredWrite.abort` when
        the stream ends early, or the reservations stay until the process ends."""
        return self._writes.begin_layers(p, model, layout, items, layers, path)

    def reserve_leased(
        self, p: Principal, model: str, layout: str, items: Sequence[WriteItem], owner: int
    ) -> list[Lease | KVStoreError | None]:
        """Path 4, phase one: a write lease on a reservation in the shared segment for
        each item (None when stored already, or that item's error), lasting as long as
        the batch takes at the floor rate plus the grace (at most ``lease_ttl_s``)."""
        return self._shm.reserve(p, model, layout, items, owner)

    def commit_leased(
        self,
        p: Principal,
        items: Sequence[CommitItem | CreditBind],
        model: str = "",
        layout: str = "",
        owner: int = 0,
    ) -> list[bool | KVStoreError]:
        """Paths 4 and 5, phase two: True stored, False stored already, or the item's
        error (an expired or unknown lease is a ReservationError). A CreditBind first
        names the block its credit holds, in the namespace of ``model`` and ``layout``;
        a block that does not fit its credit fails and frees it."""
        return self._shm.commit(p, items, model, layout, owner)

    def lend_credits(
        self, p: Principal, model: str, layout: str, sizes: Sequence[int], owner: int
    ) -> list[Lease]:
        """Path 5: write credits for a same-host writer's next puts, as many of
        ``sizes`` as its connection ``owner`` may hold (at most max_batch a request, a
        cap in bytes live at a time): for each, an extent of the shared segment
        reserved for a block of that many bytes in this scope, under a CREDIT lease of
        ``lease_ttl_s`` (unused, it expires and frees its space). Granting stops at the
        first size that cannot be had (no room, the tenant's quota): a credit is an
        optimisation, the writer reserves as before without one."""
        return self._shm.lend_credits(p, model, layout, sizes, owner)

    def abort_leased(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """Abort same-host writes and credits; returns (aborted, expired or unknown)."""
        return self._shm.abort(p, lease_ids)

    def _end_lease(self, lease: Lease) -> None:
        if lease.kind is LeaseKind.READ:
            self.node.close_read(lease.obj)
        elif lease.kind is LeaseKind.WRITE or lease.kind is LeaseKind.CREDIT:
            self.node.abort(lease.obj)
        else:  # FILL: cut the stalled connection; its thread aborts the reservation
            self.books.stalled(lease.tenant)
            lease.obj()

    # -- admin -------------------------------------------------------------------------

    def stats(self, p: Principal) -> tuple[dict[str, Any], dict[str, int]]:
        """Node stats and server counters (any authenticated caller: no keys in them).

        Per-tenant counters name tenants, so a non-admin caller sees only its own."""
        server = self.books.counters.snapshot()
        if not p.admin:
            server = {k: v for k, v in server.items() if split_key(k)[1] in (None, p.tenant)}
        server.update({name: fn() for name, fn in self.gauges.items()})
        server.update(self.books.quota_usage(p))
        credits = self.leases.count(LeaseKind.CREDIT)
        server["leases"] = len(self.leases) - credits
        server["credits_lent"] = credits
        server["leases_expired"] = self.leases.expired
        server["draining"] = int(self.draining)
        return self.node.stats(), server

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
        self.books.draining = draining
        log.info("draining %s", "on" if draining else "off")
        return self.draining
