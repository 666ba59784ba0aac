"""Shared-memory transport: same-host clients copy straight out of (and into) the node's
DRAM segment, one numpy copy per block, with the socket carrying only leases.

Direct read (the default, kvstore/client/transport/shm_direct.py): a DRAM block is found in the
server's published index and copied with no round trip at all; the server hears of it
afterwards in a batched TOUCH. What that path cannot serve (a key not published, an
unknown scope, a slot rewritten during the copy) falls through to a leased read.

Leased read: LEASE names the keys; the server pins each DRAM hit and replies with its header,
extent offset and a read lease that expires at ``lease_expires_ns`` (CLOCK_MONOTONIC,
one clock for the whole host). The client copies ``offset + 128 ..`` into the
destination, then hands the leases back with RELEASE (no reply), sent ahead of its
next request on that connection or after a few idle milliseconds. A
block that is not in DRAM (an SSD read that could not be promoted, an HBM block) comes
inline on the socket as with TCP.

A reader whose lease expired must never get wrong bytes. After copying it checks the
deadline: past it, the block is a miss (counted as ``shm_lease_expired``); before it,
the copy happened entirely under the pin, because the reaper only frees extents whose
deadline has passed on the same CLOCK_MONOTONIC. That the clock is shared is checked
on every reply (the server's grant time must fall between the client's send and
receive); when it is not, or with ``verify_shm`` on, the xxh3 of what was copied is
checked too (a mismatch: a miss, counted as ``corrupt_transfers``). Like the node's own
DRAM reads, a pinned copy is not checksummed by default: it costs ~18 us per MiB.

Write: RESERVE returns an extent and a write lease per value; the client copies each
payload into ``offset + 128 ..`` and COMMITs with the xxh3 of its source bytes, which the
node checks against the slab before the block becomes visible. A batch goes in rounds of
RESERVE -> copy -> COMMIT of at most half the segment each: reservations are not blocks
the node can demote, so a batch reserved whole could never be larger than free DRAM,
while committed rounds make room for the next by demoting to SSD. Items a round could
not reserve for lack of room (CapacityError) go again in the next round while rounds
make progress.

Same-host clients are trusted with the segment (it is mapped read-write, owner-only): a
buggy one can scribble on other blocks, which readers then reject by checksum.

Isolation: whoever maps the segment can read every block in it, whatever its tenant.
Only processes of the server's Unix user can (the file is mode 0600); tenants that must
not see each other's bytes run as other users, whose clients fail to map the segment
and use TCP, where every key is scoped by the token's tenant on the server.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import HEADER_SIZE, BlockHeader, ValueInfo, checksum, layer_span
from kvstore.client.device.side import DeviceSide
from kvstore.client.transport.base import LayerSink
from kvstore.client.transport.buffers import (
    Outgoing,
    copy_hashed,
    fresh_landing,
    out_landing,
    prepare_writes,
)
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.device_paths import (
    copy_in_device,
    direct_into_device,
    leased_into_device,
)
from kvstore.client.transport.shm_direct import FALLBACK, DirectReader
from kvstore.client.transport.tcp import SocketTransport, miss, put_results, ranged, receive_inline
from kvstore.errors import (
    CapacityError,
    KVStoreError,
    ReservationError,
    StorageError,
    TimeoutError_,
    TransportError,
)
from kvstore.observe.counters import NodeCounters
from kvstore.shm.prefault import Prefaulter
from kvstore.shm.segment import map_segment, unmap
from kvstore.wire.codec import error_of, meta_of
from kvstore.wire.frames import Op

__all__ = ["Segment", "ShmTransport"]

log = logging.getLogger(__name__)


class Placed(NamedTuple):
    """An item of a write round and the extent it is copied into: a credit's
    (``credited``: its COMMIT names the block) or one a RESERVE granted."""

    item: Outgoing
    lease_id: int
    offset: int
    credited: bool


class WritePlan(NamedTuple):
    """A write round once placed: the items with an extent, those refused for lack of
    room (tried again in a later round), and the credits its last COMMIT asks for."""

    placed: list[Placed]
    refused: list[Outgoing]
    want: list[int]


class RoundOutcome(NamedTuple):
    """What a write round did: how many items it wrote (copied and committed, whatever
    their outcome) and the items to write again."""

    written: int
    again: list[Outgoing]


class Segment:
    """A read-write mapping of a node's DRAM segment in this process."""

    def __init__(self, name: str, size: int, *, prefault: int = 0) -> None:
        if not name or size <= 0:
            raise StorageError("the server has no shared-memory segment")
        self.name = name
        self.size = size
        self._mm: mmap.mmap | None = map_segment(name, size, create=False)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)
        # the first write to each page of this mapping would fault: fill the page
        # tables in the background (kvstore/shm/prefault.py)
        self.prefaulter = Prefaulter(self.view.ctypes.data, size, limit=prefault)

    def extent(self, offset: int, n: int) -> np.ndarray:
        """The payload bytes of the block whose extent starts at ``offset``."""
        start = offset + HEADER_SIZE
        if offset < 0 or start + n > self.size:
            raise TransportError(
                f"extent [{offset}, +{n}) lies outside the {self.size}-byte segment"
            )
        return self.view[start : start + n]

    def close(self) -> None:
        """Drop the mapping (it lingers while a view of it is alive)."""
        if self._mm is not None:
            self.prefaulter.stop()  # before the mapping may go
            del self.view
            # a caller may still hold a view; the mapping then goes when the view does
            unmap(self._mm)
            self._mm = None


class ShmTransport(SocketTransport):
    """Payload copies through the node's shared-memory segment."""

    name = "shm"

    def __init__(
        self,
        counters: NodeCounters,
        segment: Segment,
        *,
        verify: bool = False,
        direct: DirectReader | None = None,
        credits: bool = True,
        device: DeviceSide | None = None,
    ) -> None:
        super().__init__(counters, device if device is not None else DeviceSide())
        # registered with CUDA on the first device call (a stand-in without a mapping: none)
        self.device.segment = getattr(segment, "view", None)
        self.segment = segment
        self.verify = verify
        self.direct = direct
        self.credits = credits  # use write credits where the server lends them

    def close(self) -> None:
        """Drop the index and segment mappings (they linger while views are alive)."""
        if self.direct is not None:
            self.direct.close()
        self.device.close()  # unregistered before the mapping goes
        self.segment.close()

    def read(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        if outs is not None and self.device.takes(outs):
            return direct_into_device(
                conn,
                keys,
                outs,
                scope,
                deadline,
                layers,
                self.direct,
                self.device,
                verify=self.verify,
                counters=self.counters,
                leased=self._leased,
            )
        d = self.direct
        nsfp = d.namespace(scope.model, scope.layout) if d is not None else None
        if d is None or nsfp is None or not d.alive():
            return self._leased(conn, keys, outs, scope, deadline, layers)
        t0 = time.perf_counter()
        get_into = outs is not None
        results: list[Any] = []
        rest: list[int] = []
        served: list[bytes] = []
        nbytes = 0
        for i, skey in enumerate(d.scoped(list(keys))):
            if time.monotonic() >= deadline:  # no round trip would notice: check here
                raise TimeoutError_(f"deadline passed after {i} of {len(keys)} direct reads")
            out = outs[i] if outs is not None else None
            r, n = d.read(skey, out, get_into, nsfp, self.verify, self.counters, layers)
            results.append(r)
            if r is FALLBACK:
                rest.append(i)
            elif n:
                served.append(keys[i])
                nbytes += n
        if served:
            self.counters.inc("shm_direct_reads", len(served))
            whole = None if rest else time.perf_counter() - t0  # else LEASE is timed
            conn.defer_touch(served, nbytes, whole)
        if rest:
            more = self._leased(
                conn,
                [keys[i] for i in rest],
                [outs[i] for i in rest] if outs is not None else None,
                scope,
                deadline,
                layers,
            )
            for i, r in zip(rest, more, strict=True):
                results[i] = r
        return results

    def _leased(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        """Read under leases the server grants in one round trip (DRAM hits) or inline
        (everything else); teaches the direct reader the scope's namespace."""
        req = ranged(pb.GetRequest(scope=scope, keys=keys), layers)
        sent_ns = time.monotonic_ns()
        resp, _ = conn.call(Op.LEASE, req, pb.GetResponse, deadline)
        if self.direct is not None:
            self.direct.learn(scope.model, scope.layout, resp.namespace_fp)
        verify = self.verify or not sent_ns <= resp.server_now_ns <= time.monotonic_ns()
        if verify and not self.verify:
            self.counters.inc("shm_clock_mismatch")  # not one clock: checksums decide
        if len(resp.blocks) != len(keys):
            conn.fs.broken = True
            raise TransportError(f"{len(resp.blocks)} blocks for {len(keys)} keys")
        get_into = outs is not None
        leases = [ref.lease_id for ref in resp.blocks if ref.lease_id]
        results = []
        try:
            if outs is not None and self.device.takes(outs):  # pinned until the event
                return leased_into_device(
                    conn, resp, outs, self.device, self.counters, verify, layers
                )
            for i, ref in enumerate(resp.blocks):
                out = outs[i] if outs is not None else None
                if ref.lease_id:
                    expires = resp.lease_expires_ns
                    results.append(self._copy_out(ref, out, get_into, expires, verify, layers))
                else:
                    results.append(receive_inline(conn, ref, out, get_into, self.counters, layers))
        finally:
            conn.defer_release(leases)  # with the next request, or the pool's flush
        return results

    def _copy_out(
        self,
        ref: pb.BlockRef,
        out: Any,
        get_into: bool,
        expires_ns: int,
        verify: bool,
        layers: tuple[int, int] | None = None,
    ) -> Any:
        header = BlockHeader.unpack(ref.header)
        extent = self.segment.extent(ref.offset, header.payload_len)
        try:
            if layers is None:
                landing = out_landing(header, out) if get_into else fresh_landing(header)
            else:
                lo, hi = layer_span(header, layers)
                landing = out_landing(header, out, hi - lo)
                if verify and checksum(extent) != header.checksum:  # the whole, then a part
                    landing = None
                extent = extent[lo:hi]
        except KVStoreError as exc:
            return exc
        if landing is not None:
            np.copyto(landing.view, extent)
        if time.monotonic_ns() >= expires_ns:
            self.counters.inc("shm_lease_expired")
            log.info("read lease of %s expired during the copy; served as a miss", header.key.hex())
            return miss(get_into)
        if landing is None or (
            verify and layers is None and checksum(landing.view) != header.checksum
        ):
            self.counters.inc("corrupt_transfers")
            log.warning(
                "block %s copied from shared memory failed its checksum; a miss", header.key.hex()
            )
            return miss(get_into)
        return landing.finish()

    def write(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        values: Sequence[Any],
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        results: list[Any] = [None] * len(keys)
        limit = conn.info.limits.max_value_bytes
        dev = self.device.engine.claims if self.device.takes(values) else None
        pending = prepare_writes(keys, values, results, limit, hashed=False, on_device=dev)
        budget = max(self.segment.size // 2, 1)
        while pending:
            batch, pending = _take_round(pending, budget)
            granted, refused = self._write_round(conn, batch, scope, deadline, results)
            if granted and refused:  # room may come from this round's demotions
                self.counters.inc("shm_write_rerounds", len(refused))
                pending = refused + pending
        return results

    def begin_layers(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        infos: Sequence[ValueInfo],
        layers: int,
        scope: pb.Scope,
        deadline: float,
    ) -> LayerSink:
        """RESERVE every item now; each layer range is then copied straight into its
        extent, with no round trip, and one COMMIT (and an ABORT of the withdrawn)
        ends the write."""
        req = pb.PutRequest(scope=scope)
        for key, info in zip(keys, infos, strict=True):
            req.items.add(key=key, meta=meta_of(info))
        resp, _ = conn.call(Op.RESERVE, req, pb.PutResponse, deadline)
        if len(resp.results) != len(keys):
            conn.fs.broken = True
            raise TransportError(f"{len(resp.results)} results for {len(keys)} values")
        early: list[Any] = [None] * len(keys)
        extents: list[np.ndarray | None] = []
        leases: list[int] = []
        for i, (info, r) in enumerate(zip(infos, resp.results, strict=True)):
            if r.lease_id:
                extents.append(self.segment.extent(r.offset, info.nbytes))
            else:
                early[i] = error_of(r.error) or r.stored
                extents.append(None)
            leases.append(r.lease_id)
        return _ShmLayers(conn, extents, leases, early, resp.lease_expires_ns)

    def _write_round(
        self,
        conn: DataConn,
        items: list[Outgoing],
        scope: pb.Scope,
        deadline: float,
        results: list[Any],
    ) -> RoundOutcome:
        """Copy and COMMIT ``items`` one by one, each into the extent :meth:`_place`
        found for it; every item's outcome that is final is in ``results``.

        Each COMMIT goes out as soon as its item is copied and its reply is read at the
        end: the server checks and seals item i on its CPU while this one copies item
        i + 1. A round whose items all have credits costs the copies and one round
        trip; the last COMMIT (or the RESERVE) asks for as many credits as the round has
        items, so the next round of the same sizes has them."""
        skey = scope.SerializeToString()
        plan = self._place(conn, items, scope, skey, deadline, results)
        work, want = plan.placed, plan.want
        if not work:
            return RoundOutcome(0, plan.refused)
        sent = 0
        # device values: D2H into the extents, item j hashed while j + 1 copies
        sums = (
            copy_in_device(self.device, [(p.item, p.offset) for p in work])
            if work[0].item.device is not None
            else None
        )
        try:
            for j, placed in enumerate(work):
                last = j == len(work) - 1
                if sums is not None:
                    placed.item.sum = next(sums)[1]
                else:
                    dst = self.segment.extent(placed.offset, placed.item.info.nbytes)
                    placed.item.sum = copy_hashed(dst, placed.item.data)
                commit = self._commit_for(placed, scope, want if last else [])
                conn.send_only(Op.COMMIT, commit, deadline)
                sent += 1
        finally:
            if sums is not None:
                sums.close()  # waits for copies still queued
            self._commit_replies(conn, work, sent, deadline, results, skey, want)
        lapsed = [
            p.item
            for p in work[:sent]
            if p.credited and isinstance(results[p.item.index], ReservationError)
        ]
        for it in lapsed:  # its credit expired before the COMMIT: write it again
            results[it.index] = None
        return RoundOutcome(len(work), plan.refused + lapsed)

    def _place(
        self,
        conn: DataConn,
        items: list[Outgoing],
        scope: pb.Scope,
        skey: bytes,
        deadline: float,
        results: list[Any],
    ) -> WritePlan:
        """Where each item of a round goes: a credit this connection holds (credits.py)
        or, for those without one, an extent one RESERVE asks for (with the credits for
        the next round); the RESERVE's errors and already-present keys go to
        ``results``, and the items it refused for lack of room come back to retry."""
        lend = self.credits and conn.info.put_credits
        placed: list[Placed] = []
        rest: list[Outgoing] = []
        for it in items:
            credit = conn.credits.take(skey, it.info.nbytes) if lend else None
            if credit is None:
                rest.append(it)
            else:
                placed.append(Placed(it, credit.lease_id, credit.offset, True))
        want = [it.info.nbytes for it in items] if lend else []
        if not rest:
            return WritePlan(placed, [], want)
        req = pb.PutRequest(scope=scope, credits=want)
        for it in rest:
            req.items.add(key=it.key, meta=meta_of(it.info))
        resp, _ = conn.call(Op.RESERVE, req, pb.PutResponse, deadline)
        put_results(resp, rest, results)  # errors and already-present keys
        conn.credits.keep(skey, want, resp)
        for it, r in zip(rest, resp.results, strict=True):
            if r.lease_id:
                placed.append(Placed(it, r.lease_id, r.offset, False))
        refused = [it for it in rest if isinstance(results[it.index], CapacityError)]
        return WritePlan(placed, refused, [])

    def _commit_for(self, placed: Placed, scope: pb.Scope, want: list[int]) -> pb.CommitRequest:
        """The COMMIT that seals an item copied into its extent (``it.sum`` the xxh3 of
        its bytes): one naming the block when the extent is a credit, and asking for
        ``want`` credits (the round's last COMMIT, when the RESERVE did not ask)."""
        it = placed.item
        commit = pb.CommitRequest()
        item = commit.items.add(lease_id=placed.lease_id, checksum=it.sum)
        if placed.credited:
            item.key = it.key
            item.meta.CopyFrom(meta_of(it.info))
        if placed.credited or want:
            commit.scope.CopyFrom(scope)
        if want:
            commit.credits.extend(want)
        return commit

    def _commit_replies(
        self,
        conn: DataConn,
        work: list[Placed],
        sent: int,
        deadline: float,
        results: list[Any],
        scope: bytes,
        want: list[int],
    ) -> None:
        """Read the replies to the ``sent`` COMMITs in flight (the last one with the
        credits asked for) and abort the leases of the items never committed (a copy
        failed): nothing half-copied becomes visible, and the stream stays in step for
        the connection's next request."""
        for j, placed in enumerate(work[:sent]):
            try:
                resp = conn.read_reply(Op.COMMIT, pb.PutResponse, deadline)
            except KVStoreError as exc:
                if not conn.usable:
                    raise
                results[placed.item.index] = exc  # this request failed whole; the others answer
                continue
            put_results(resp, [placed.item], results)
            if want and j == len(work) - 1:
                conn.credits.keep(scope, want, resp)
        rest = [p.lease_id for p in work[sent:]]
        if rest and conn.usable:
            conn.call(Op.ABORT, pb.LeaseRequest(lease_ids=rest), pb.LeaseResponse, deadline)


_LAYER_MARGIN_NS = 50_000_000  # a layer copy must end this long before the lease does


class _ShmLayers(LayerSink):
    """A layer-by-layer write into reserved extents of the shared segment."""

    def __init__(
        self,
        conn: DataConn,
        extents: list[np.ndarray | None],
        leases: list[int],
        early: list[Any],
        expires_ns: int,
    ) -> None:
        self.conn, self.extents, self.leases, self.early = conn, extents, leases, early
        self.expires_ns = expires_ns  # the write leases' end (CLOCK_MONOTONIC, the host's)
        self.filled = [0] * len(extents)  # bytes of each extent written so far

    def send(self, parts: Sequence[Any], deadline: float) -> None:
        # Past the leases' end the server may have given the extents to other blocks:
        # never copy into them then (a margin covers the copy itself).
        if any(self.leases) and time.monotonic_ns() > self.expires_ns - _LAYER_MARGIN_NS:
            self.leases = []  # reaped by the server: nothing to abort
            raise TimeoutError_(
                "the layer-by-layer write's reservations expired (lease_ttl_s, put_grace_s)"
            )
        for i, part in enumerate(parts):
            dst = self.extents[i]
            if dst is None:
                continue
            src = np.frombuffer(part, np.uint8)
            at = self.filled[i]
            if at + src.size > dst.size:
                raise TransportError(
                    f"item {i}: {at + src.size} bytes for a {dst.size}-byte extent"
                )
            np.copyto(dst[at : at + src.size], src)
            self.filled[i] = at + src.size

    def finish(self, sums: Sequence[int], keep: Sequence[bool], deadline: float) -> list[Any]:
        out = list(self.early)
        commit, drop, order = pb.CommitRequest(), [], []
        for i, lease in enumerate(self.leases):
            if not lease:
                continue
            if keep[i]:
                commit.items.add(lease_id=lease, checksum=sums[i])
                order.append(i)
            else:
                drop.append(lease)
        self.leases = []
        if drop:
            self.conn.call(Op.ABORT, pb.LeaseRequest(lease_ids=drop), pb.LeaseResponse, deadline)
        if order:
            resp, _ = self.conn.call(Op.COMMIT, commit, pb.PutResponse, deadline)
            if len(resp.results) != len(order):
                self.conn.fs.broken = True
                raise TransportError(f"{len(resp.results)} results for {len(order)} commits")
            for i, r in zip(order, resp.results, strict=True):
                out[i] = error_of(r.error) or r.stored
        return out

    def abort(self, deadline: float) -> None:
        held, self.leases = [lease for lease in self.leases if lease], []
        if not held or not self.conn.usable:
            return  # a connection that went away took its leases with it
        try:
            self.conn.call(Op.ABORT, pb.LeaseRequest(lease_ids=held), pb.LeaseResponse, deadline)
        except KVStoreError:
            self.conn.fs.broken = True  # dropped by the pool: the server ends its leases


def _take_round(items: list[Outgoing], budget: int) -> tuple[list[Outgoing], list[Outgoing]]:
    """The leading items whose extents fit ``budget`` bytes (at least one), and the rest."""
    total = 0
    for n, it in enumerate(items):
        total += HEADER_SIZE + it.info.nbytes
        if total > budget and n:
            return items[:n], items[n:]
    return items, []
