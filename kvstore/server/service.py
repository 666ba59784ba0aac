"""gRPC servicer (grpc.aio) of the control plane: a thin codec over the Gateway.

The control plane carries no block payloads: gets and puts, leased same-host reads and
writes included, go over the data socket (kvstore/server/dataserver.py). Here are Info
and Health, the metadata calls (Exists, MatchPrefix, Lookup, Remove), Stats, and the
admin calls (Evict, Drain, Scan, and Export/Import/Purge, whose blocks travel inline
for ``kvstore drain``).

Each handler authenticates the call's bearer token to a Principal, decodes the request,
calls the Gateway (or Maintenance for the admin calls) and encodes the reply. Calls that
only read the index under the node's lock (Exists, MatchPrefix, Lookup, Info, Health,
Drain) run on the event loop; anything that may touch the SSD tier or copy blocks runs
in the thread pool, so one slow disk never stalls other clients' control calls. Store
errors leave through ``grpc_errors.abort`` (status + stable code); anything else is
logged and sent as an internal error without its details.

Requests are registered with :func:`add_to_server`, whose parsing hands a request that
does not decode to its handler, which answers INVALID_ARGUMENT once the caller has
authenticated (grpc's own parsing would answer UNKNOWN and log a traceback per call).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.errors import InvalidValue, KVStoreError
from kvstore.server.auth import TokenTable
from kvstore.server.gateway import Gateway
from kvstore.server.maintenance import EvictSpec, ImportItem, Maintenance, ScanSpec
from kvstore.tenants import Principal
from kvstore.wire import grpc_errors
from kvstore.wire.codec import info_from_meta, stats_to_proto, status_of

__all__ = ["StoreServicer", "add_to_server"]

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
                if isinstance(request, _Undecodable):
                    raise InvalidValue(request.error)
                return await fn(self, p, request)
            except KVStoreError as exc:
                await grpc_errors.abort(context, exc)
            except Exception:
                log.exception("%s failed", fn.__name__)
                await grpc_errors.abort(context, KVStoreError("internal error (see server log)"))

        return handler

    return deco


class _Undecodable:
    """A request whose bytes are not its message (answered INVALID_ARGUMENT by _rpc)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Undecodable(f"undecodable {cls.DESCRIPTOR.name}: {exc}")

    return parse


def add_to_server(servicer: StoreServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as store_pb2_grpc.add_StoreServicer_to_server does, but
    with request parsing that never raises (see :class:`_Undecodable`)."""
    service = pb.DESCRIPTOR.services_by_name["Store"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(message_factory.GetMessageClass(m.input_type)),
            response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


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
            tenant, model = self.gw.books.names.get(fp) or ("", "")
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
