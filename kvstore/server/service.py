"""gRPC servicer (grpc.aio) of the control plane: a thin codec over the Gateway.

Each handler authenticates the call's bearer token to a Principal, decodes the request,
calls the Gateway and encodes the reply. Calls that only read the index under the node's
lock (Exists, MatchPrefix, Lookup, Info, Health, Drain) run on the event loop; anything
that may copy payload bytes or touch the SSD tier runs in the thread pool, so one slow
disk read never stalls other clients' control calls. Store errors leave through
``grpc_errors.abort`` (status + stable code); anything else is logged and sent as an
internal error without its details.

Counting (kvstore/observe/names.py): payload bytes by path (``grpc`` inline, ``shm``
for leased reads and Reserve/Commit writes) and one latency observation per Get,
OpenRead, Put and Commit, timed around the handler's work in the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError, LimitExceeded
from kvstore.node.store import BlockRead
from kvstore.server.auth import TokenTable
from kvstore.server.gateway import Gateway
from kvstore.server.maintenance import EvictSpec, ImportItem, Maintenance, ScanSpec
from kvstore.tenants import Principal
from kvstore.tiering import TierKind
from kvstore.wire import grpc_errors
from kvstore.wire.codec import info_from_meta, stats_to_proto, status_of

__all__ = ["StoreServicer"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[Any, Principal, Any], Awaitable[Any]]


def _rpc(admin: str | None = None) -> Callable[[Handler], Any]:
    """Authenticate, check admin rights, and map errors for one handler."""

    def deco(fn: Handler) -> Any:
        @functools.wraps(fn)
        async def handler(self: StoreServicer, request: Any, context: Any) -> Any:
            try:
                p = self.tokens.from_metadata(context.invocation_metadata())
                if admin:
                    p.require_admin(admin)
                return await fn(self, p, request)
            except KVStoreError as exc:
                await grpc_errors.abort(context, exc)
            except Exception:
                log.exception("%s failed", fn.__name__)
                await grpc_errors.abort(context, KVStoreError("internal error (see server log)"))

        return handler

    return deco


class StoreServicer(pb_grpc.StoreServicer):
    """kvstore.v1.Store over one Gateway."""

    def __init__(
        self,
        gateway: Gateway,
        tokens: TokenTable,
        info: Callable[[Principal], pb.InfoResponse],
        pool: ThreadPoolExecutor,
    ) -> None:
        self.gw = gateway
        self.admin = Maintenance(gateway)
        self.tokens = tokens
        self.info = info
        self.pool = pool

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @_rpc()
    async def Info(self, p: Principal, req: pb.InfoRequest) -> pb.InfoResponse:
        return self.info(p)

    @_rpc()
    async def Health(self, p: Principal, req: pb.HealthRequest) -> pb.HealthResponse:
        info = self.info(p)
        status = pb.HealthResponse.DRAINING if self.gw.draining else pb.HealthResponse.SERVING
        return pb.HealthResponse(status=status, version=info.version, instance_id=info.instance_id)

    @_rpc()
    async def Exists(self, p: Principal, req: pb.KeysRequest) -> pb.ExistsResponse:
        return pb.ExistsResponse(present=self.gw.exists(p, req.keys))

    @_rpc()
    async def MatchPrefix(self, p: Principal, req: pb.KeysRequest) -> pb.MatchPrefixResponse:
        return pb.MatchPrefixResponse(matched=self.gw.match_prefix(p, req.keys))

    @_rpc()
    async def Lookup(self, p: Principal, req: pb.KeysRequest) -> pb.LookupResponse:
        return pb.LookupResponse(tier=self.gw.lookup(p, req.keys))

    @_rpc()
    async def Remove(self, p: Principal, req: pb.KeysRequest) -> pb.RemoveResponse:
        return pb.RemoveResponse(removed=await self._run(self.gw.remove, p, list(req.keys)))

    @_rpc()
    async def Get(self, p: Principal, req: pb.GetRequest) -> pb.GetResponse:
        return await self._run(self._get, p, req, False)

    @_rpc()
    async def OpenRead(self, p: Principal, req: pb.GetRequest) -> pb.GetResponse:
        return await self._run(self._get, p, req, True)

    def _get(self, p: Principal, req: pb.GetRequest, lease: bool) -> pb.GetResponse:
        """Get (payloads inline) or OpenRead (DRAM hits leased, the rest inline)."""
        with self.gw.counters.time("get", "shm" if lease else "grpc"):
            return self._get_timed(p, req, lease)

    def _get_timed(self, p: Principal, req: pb.GetRequest, lease: bool) -> pb.GetResponse:
        ns = self.gw.namespace(p, req.scope.model, req.scope.layout)
        reads = self.gw.open_reads(p, req.keys, ns)
        leased: dict[int, int] = {}  # id(read) -> lease id
        resp = pb.GetResponse(shm_name=(self.gw.node.shm_name or "") if lease else "")
        resp.server_now_ns = time.monotonic_ns() if lease else 0
        try:
            budget = self.gw.config.max_inline_bytes
            shm_bytes = 0
            for r in reads:
                ref = resp.blocks.add(offset=-1)
                if isinstance(r, KVStoreError):
                    ref.error.CopyFrom(status_of(r))
                    continue
                if r is None:
                    continue
                ref.found, ref.header = True, r.header.pack()
                if lease and self.gw.shm_offset(r) >= 0:
                    granted = self.gw.lease_read(p, r, None)
                    leased[id(r)] = ref.lease_id = granted.id
                    ref.offset = r.offset
                    resp.lease_expires_ns = resp.lease_expires_ns or granted.expires_ns
                    shm_bytes += r.header.payload_len
                    continue
                budget -= r.header.payload_len
                if budget < 0:
                    raise LimitExceeded(
                        f"inline payloads exceed max_inline_bytes "
                        f"{self.gw.config.max_inline_bytes}; fetch them over the data socket"
                    )
                ref.payload = _payload_bytes(r)
            self.gw.count_out(p, "shm", shm_bytes)
            self.gw.count_out(p, "grpc", self.gw.config.max_inline_bytes - budget)
            return resp
        except BaseException:
            self.gw.release_reads(p, list(leased.values()))
            raise
        finally:
            self.gw.close_reads([r for r in reads if id(r) not in leased])

    @_rpc()
    async def CloseRead(self, p: Principal, req: pb.LeaseRequest) -> pb.LeaseResponse:
        done, expired = await self._run(self.gw.release_reads, p, list(req.lease_ids))
        return pb.LeaseResponse(released=done, expired=expired)

    @_rpc()
    async def Put(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        total = sum(len(it.payload) for it in req.items)
        if total > self.gw.config.max_inline_bytes:
            raise LimitExceeded(
                f"inline payloads of {total} bytes exceed max_inline_bytes "
                f"{self.gw.config.max_inline_bytes}; send them over the data socket"
            )
        return await self._run(self._put, p, req)

    def _put(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        with self.gw.counters.time("put", "grpc"):
            return self._put_timed(p, req)

    def _put_timed(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        self.gw.check_batch(len(req.items))
        ns = self.gw.namespace(p, req.scope.model, req.scope.layout)
        resp = pb.PutResponse()
        for item in req.items:
            out = resp.results.add()
            try:
                info = info_from_meta(item.meta)
                out.stored = self.gw.put_inline(p, item.key, info, item.payload, item.checksum, ns)
            except KVStoreError as exc:
                out.error.CopyFrom(status_of(exc))
        return resp

    @_rpc()
    async def Reserve(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        return await self._run(self._reserve, p, req)

    def _reserve(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        self.gw.check_batch(len(req.items))
        ns = self.gw.namespace(p, req.scope.model, req.scope.layout)
        resp = pb.PutResponse(shm_name=self.gw.node.shm_name or "")
        for item in req.items:
            out = resp.results.add()
            try:
                lease = self.gw.reserve_leased(p, item.key, info_from_meta(item.meta), ns, None)
            except KVStoreError as exc:
                out.error.CopyFrom(status_of(exc))
                continue
            if lease is not None:
                out.lease_id, out.offset = lease.id, lease.obj.offset
                resp.lease_expires_ns = resp.lease_expires_ns or lease.expires_ns
        return resp

    @_rpc()
    async def Commit(self, p: Principal, req: pb.CommitRequest) -> pb.PutResponse:
        return await self._run(self._commit, p, req)

    def _commit(self, p: Principal, req: pb.CommitRequest) -> pb.PutResponse:
        self.gw.check_batch(len(req.items))
        resp = pb.PutResponse()
        with self.gw.counters.time("put", "shm"):
            for item in req.items:
                out = resp.results.add()
                try:
                    out.stored = self.gw.commit_leased(p, item.lease_id, item.checksum)
                except KVStoreError as exc:
                    out.error.CopyFrom(status_of(exc))
        return resp

    @_rpc()
    async def Abort(self, p: Principal, req: pb.LeaseRequest) -> pb.LeaseResponse:
        done, expired = await self._run(self.gw.abort_leased, p, list(req.lease_ids))
        return pb.LeaseResponse(released=done, expired=expired)

    @_rpc()
    async def Stats(self, p: Principal, req: pb.StatsRequest) -> pb.StatsResponse:
        node_stats, server = await self._run(self.gw.stats, p)
        return stats_to_proto(node_stats, server)

    @_rpc(admin="evict")
    async def Evict(self, p: Principal, req: pb.EvictRequest) -> pb.EvictResponse:
        spec = EvictSpec(
            req.tier,
            req.target_bytes,
            req.tenant,
            req.model,
            req.key_prefix,
            req.idle_s,
            req.dry_run,
            min(req.list_limit, self.gw.config.max_batch),
        )
        r = await self._run(self.admin.evict, p, spec)
        resp = pb.EvictResponse(
            moved=r.moved,
            skipped_pinned=r.skipped_pinned,
            bytes=r.nbytes,
            demoted=r.demoted,
            dropped=r.dropped,
            used_before=r.used_before,
            used_after=r.used_after,
            capacity=r.capacity,
            dry_run=r.dry_run,
            next_tier=r.next_tier,
        )
        for key, size in r.blocks:
            resp.blocks.add(key=key, tier=r.tier, size=size)
        return resp

    @_rpc(admin="drain")
    async def Drain(self, p: Principal, req: pb.DrainRequest) -> pb.DrainResponse:
        return pb.DrainResponse(draining=await self.gw.set_draining(p, req.draining))

    @_rpc(admin="scan")
    async def Scan(self, p: Principal, req: pb.ScanRequest) -> pb.ScanResponse:
        spec = ScanSpec(req.tenant, req.model, req.key_prefix)
        rows, more = await self._run(self.admin.scan, p, req.limit, req.tier, spec)  # walks index
        resp = pb.ScanResponse(more=more)
        for key, tier, size, fp in rows:
            tenant, model = self.gw.names.get(fp) or ("", "")
            resp.blocks.add(key=key, tier=tier.value, size=size, tenant=tenant, model=model)
        return resp

    @_rpc(admin="export")
    async def Export(self, p: Principal, req: pb.KeysRequest) -> pb.GetResponse:
        budget = self.gw.config.max_message_bytes - 64 * 1024  # room for the headers
        blocks = await self._run(self.admin.export, p, list(req.keys), budget)
        resp = pb.GetResponse()
        for b in blocks:
            ref = resp.blocks.add(offset=-1)
            if b is not None:
                ref.found, ref.header, ref.payload = True, b.header, b.payload
                ref.tenant, ref.model = b.tenant, b.model
        return resp

    @_rpc(admin="import")
    async def Import(self, p: Principal, req: pb.PutRequest) -> pb.PutResponse:
        resp = pb.PutResponse()
        items, slots = [], []
        for it in req.items:
            out = resp.results.add()
            try:
                info = info_from_meta(it.meta)
            except KVStoreError as exc:
                out.error.CopyFrom(status_of(exc))
                continue
            items.append(
                ImportItem(
                    it.key, info, it.payload, it.checksum, it.namespace_fp, it.tenant, it.model
                )
            )
            slots.append(out)
        results = await self._run(self.admin.import_blocks, p, items)
        for out, r in zip(slots, results, strict=True):
            if isinstance(r, KVStoreError):
                out.error.CopyFrom(status_of(r))
            else:
                out.stored = r
        return resp

    @_rpc(admin="purge")
    async def Purge(self, p: Principal, req: pb.KeysRequest) -> pb.RemoveResponse:
        return pb.RemoveResponse(removed=await self._run(self.admin.purge, p, list(req.keys)))


def _payload_bytes(blk: BlockRead) -> bytes:
    payload = blk.payload
    if blk.tier is TierKind.HBM:  # a CUDA tensor: one copy to host
        payload = payload.cpu().numpy()
    return bytes(memoryview(payload).cast("B"))
