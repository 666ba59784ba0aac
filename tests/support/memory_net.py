"""An in-memory network: real clients talk to real servers in this process, no socket.

:class:`MemoryNetwork` is a :class:`~kvstore.client.connector.Connector` (the client's
one injection point, see kvstore/client/connector.py): give it to ``NodeClient(...,
connector=net)`` or ``ClusterClient(..., connector=net)`` and every call runs the
client's own logic (per-key results, batching, namespace scoping, retries, deadlines,
lifecycle, cluster fallback) against :class:`MemoryServer` objects, each a StoreNode
behind the server's own Gateway, TokenTable and gRPC servicer.

What it keeps of the wire, so the client sees what it would over a socket:

- control calls run the real ``StoreServicer`` handlers (authentication, admin checks,
  error mapping); a failure comes back through ``grpc_errors.mapped`` as the exact class;
- data calls authenticate the token once per link (HELLO), make one Gateway call per
  batch (read / write / exists / match_prefix), and carry errors, value descriptions and
  payloads through the wire's codecs (``status_of``/``error_of``, ``meta_of``/
  ``info_from_meta``); read payloads are checked against their xxh3 like a TCP
  transfer, write payloads against the writer's xxh3 at commit;
- a stopped server refuses new links and control calls (Unavailable), and a link opened
  before breaks on its next call (TransportError, ``usable`` False): what a reset does.

What it leaves out: shared memory, leases, frames and polling (the socket tests cover
them). It lives in tests/support because it sees both client/ and server/, which the
package keeps apart (tests/unit/test_layering.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
import numpy as np

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo, checksum, layer_span
from kvstore.client.connector import Connector, Locate
from kvstore.client.control import Control
from kvstore.client.transport.base import LayerSink, Link, Links, Transport
from kvstore.client.transport.buffers import fresh_landing, out_landing, prepare_writes
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import KVStoreError, TimeoutError_, TransportError, Unavailable
from kvstore.node.store import BlockRead, StoreNode
from kvstore.observe.counters import NodeCounters
from kvstore.server.auth import TokenTable
from kvstore.server.gateway import Gateway
from kvstore.server.layered import LayeredWrite
from kvstore.server.quotas import Quotas
from kvstore.server.service import StoreServicer
from kvstore.server.write_batch import UNHASHED, Filled, PayloadReceiver, WriteItem
from kvstore.tenants import Principal
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.codec import error_of, info_from_meta, meta_of, status_of
from kvstore.wire.grpc_errors import mapped

__all__ = ["TOKEN", "MemoryLinks", "MemoryNetwork", "MemoryServer", "MemoryTransport"]

TOKEN = "memory-net-admin-token"  # the default server's admin token (tenant "default")
_instances = itertools.count(1)


class MemoryServer:
    """One ``kvstore serve`` in this process, without listeners: a StoreNode (owned:
    closed with the server), its Gateway (with the tokens file's quotas, as the server
    builds it), tokens and the gRPC servicer, whose handlers run on a private event loop
    thread like grpc.aio's."""

    def __init__(
        self,
        node: StoreNode,
        address: str,
        config: ServerConfig | None = None,
        tokens: TokenTable | None = None,
        **kw: Any,
    ) -> None:
        self.node = node
        self.address = address
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.config = config or ServerConfig(**{"auth_token": TOKEN, **kw})
        self.tokens = tokens or TokenTable.from_config(self.config)
        self.gateway = Gateway(node, self.config, quotas=Quotas.from_config(self.config))
        self.instance_id = f"mem-{next(_instances)}"
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mem-server")
        self.servicer = StoreServicer(self.gateway, self.tokens, self.info, self._pool)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.up = True

    def info(self, p: Principal) -> pb.InfoResponse:
        """What a client learns at connect time (StoreServer.info without sockets)."""
        c = self.config
        return pb.InfoResponse(
            version="memory",
            node_id=self.node.node_id,
            tenant=p.tenant,
            admin=p.admin,
            scope_key=p.scope_key,
            data_port=self.port,
            lease_ttl_ms=int(c.lease_ttl_s * 1000),
            limits=pb.Limits(
                max_value_bytes=self.node.config.max_value_bytes,
                max_batch=c.max_batch,
                max_message_bytes=c.max_message_bytes,
            ),
            tiers=[t.value for t in self.node.tiers],
            instance_id=self.instance_id,
            draining=self.gateway.draining,
        )

    def close(self) -> None:
        self.up = False
        self.gateway.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
        self._pool.shutdown(wait=True)
        self.node.close()


class MemoryNetwork(Connector):
    """Servers by address, reached without sockets. ``stop(address)`` takes one off
    the network (its links break, new ones are refused), ``start(address)`` puts it
    back; the StoreNode and its blocks live on meanwhile."""

    def __init__(self) -> None:
        self._servers: dict[str, MemoryServer] = {}
        self._lock = threading.Lock()

    def add(self, server: MemoryServer) -> MemoryServer:
        with self._lock:
            self._servers[server.address] = server
        return server

    def stop(self, address: str) -> None:
        self._servers[address].up = False

    def start(self, address: str) -> None:
        self._servers[address].up = True

    def server(self, address: str) -> MemoryServer:
        """The live server at ``address``; Unavailable as a refused connect would be."""
        with self._lock:
            s = self._servers.get(address)
        if s is None or not s.up:
            raise Unavailable(f"{address}: connection refused (in-memory network)")
        return s

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for s in servers:
            s.close()

    # -- Connector -----------------------------------------------------------------------

    def control(self, host: str, port: int, config: ClientConfig) -> Control:
        return MemoryControl(self, f"{host}:{port}", config.token)

    def links(
        self,
        host: str,
        config: ClientConfig,
        counters: NodeCounters,
        locate: Locate,
        server: pb.InfoResponse,
    ) -> Links:
        return MemoryLinks(self, f"{host}:{server.data_port}", config, counters)

    def reachable(self, address: str) -> bool:
        try:
            self.server(address)
        except Unavailable:
            return False
        return True


class _Aborted(grpc.RpcError):
    """What ``context.abort`` raises: a failed call as the gRPC client sees it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


class _Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise _Aborted(code, details, trailing_metadata)


class MemoryControl(Control):
    """Control calls answered by the server's own servicer on its loop."""

    def __init__(self, net: MemoryNetwork, address: str, token: str) -> None:
        self.net = net
        self.address = address
        self._metadata = bearer_metadata(token) if token else ()
        self.closed = False

    def call(self, method: str, request: Any, deadline: float, *, wait: bool = True) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_(f"{method}: deadline passed before the call")
        server = self.net.server(self.address)
        handler = getattr(server.servicer, method)
        fut = asyncio.run_coroutine_threadsafe(
            handler(request, _Context(self._metadata)), server.loop
        )
        with mapped(method):
            try:
                return fut.result(left)
            except FutureTimeout:
                fut.cancel()
                raise TimeoutError_(f"{method}: deadline exceeded") from None

    def close(self) -> None:
        self.closed = True


class MemorySession:
    """One authenticated link to one server life (what a data socket is)."""

    def __init__(self, net: MemoryNetwork, address: str, token: str) -> None:
        server = net.server(address)
        self.net, self.address, self.instance = net, address, server.instance_id
        self.principal = server.tokens.authenticate(token)  # HELLO: AuthError if refused
        self.info = server.info(self.principal)
        self.broken = False

    @property
    def usable(self) -> bool:
        return not self.broken

    def gateway(self) -> Gateway:
        """The server's gateway, or TransportError (and broken) when it went away."""
        try:
            server = self.net.server(self.address)
        except Unavailable:
            server = None
        if self.broken or server is None or server.instance_id != self.instance:
            self.broken = True
            raise TransportError(f"{self.address}: server closed the connection")
        return server.gateway


class MemoryTransport(Transport[MemorySession]):
    """One Gateway call per batch, payloads copied (and checked) in memory."""

    name = "memory"

    def read(
        self,
        conn: MemorySession,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        gw, get_into = conn.gateway(), outs is not None
        miss = False if get_into else None
        results: list[Any] = []
        with gw.read(conn.principal, scope.model, scope.layout, keys, path="inproc") as batch:
            for i, r in enumerate(batch.items):
                if not isinstance(r, BlockRead):
                    results.append(miss if r is None else error_of(status_of(r)))
                    continue
                header = r.header
                whole = np.frombuffer(r.host(), np.uint8)
                try:
                    if layers is not None:  # the whole block checked, then a part copied
                        lo, hi = layer_span(header, layers)
                        landing = out_landing(header, outs[i], hi - lo)
                    else:
                        lo, hi = 0, header.payload_len
                        landing = (
                            out_landing(header, outs[i]) if get_into else fresh_landing(header)
                        )
                except KVStoreError as exc:
                    results.append(error_of(status_of(exc)))
                    continue
                np.copyto(landing.view, whole[lo:hi])
                if checksum(whole) != header.checksum:
                    self.counters.inc("corrupt_transfers")
                    results.append(miss)
                    continue
                results.append(landing.finish())
        return results

    def write(
        self,
        conn: MemorySession,
        keys: Sequence[bytes],
        values: Sequence[Any],
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        gw = conn.gateway()
        results: list[Any] = [None] * len(keys)
        items = prepare_writes(keys, values, results, conn.info.limits.max_value_bytes)
        if not items:
            return results
        wire = [
            WriteItem(it.key, info_from_meta(meta_of(it.info)), it.sum, it.info.nbytes)
            for it in items
        ]
        rx = _Copies([it.data for it in items])
        out = gw.write(conn.principal, scope.model, scope.layout, wire, rx, path="inproc")
        for it, r in zip(items, out, strict=True):
            results[it.index] = error_of(status_of(r)) if isinstance(r, KVStoreError) else r
        return results

    def begin_layers(
        self,
        conn: MemorySession,
        keys: Sequence[bytes],
        infos: Sequence[ValueInfo],
        layers: int,
        scope: pb.Scope,
        deadline: float,
    ) -> LayerSink:
        wire = [
            WriteItem(k, info_from_meta(meta_of(i)), 0, i.nbytes)
            for k, i in zip(keys, infos, strict=True)
        ]
        gw = conn.gateway()
        write = gw.begin_layers(conn.principal, scope.model, scope.layout, wire, layers, "inproc")
        return _MemoryLayers(conn, write)

    def exists(self, conn: MemorySession, keys: Sequence[bytes], deadline: float) -> list[bool]:
        return conn.gateway().exists(conn.principal, keys)

    def match_prefix(self, conn: MemorySession, keys: Sequence[bytes], deadline: float) -> int:
        return conn.gateway().match_prefix(conn.principal, keys)


class _Copies(PayloadReceiver):
    """A batch's values copied into their reservations in request order (an
    in-process copy: no connection, nothing to time or cut)."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = sources
        self.next = 0  # the item whose payload the gateway asks for next

    def receive(self, target: Any, nbytes: int) -> Filled:
        src = self.sources[self.next]
        self.next += 1
        memoryview(target.data).cast("B")[:nbytes] = memoryview(src).cast("B")[:nbytes]
        return UNHASHED  # the item's own checksum; the commit hashes what landed

    def skip(self, nbytes: int) -> None:
        self.next += 1


class _MemoryLayers(LayerSink):
    """A layer-by-layer write copied straight into the gateway's reservations."""

    def __init__(self, conn: MemorySession, write: LayeredWrite) -> None:
        self.conn, self.write = conn, write
        self.layer = 0

    def send(self, parts: Sequence[Any], deadline: float) -> None:
        self.conn.gateway()  # a server that went away breaks the write
        for i, part in enumerate(parts):
            dst = self.write.target(i, self.layer)
            if dst is not None:
                np.copyto(dst, np.frombuffer(part, np.uint8))
        self.layer += 1

    def finish(self, sums: Sequence[int], keep: Sequence[bool], deadline: float) -> list[Any]:
        out = self.write.finish(list(zip(sums, keep, strict=True)))
        return [error_of(status_of(r)) if isinstance(r, KVStoreError) else r for r in out]

    def abort(self, deadline: float) -> None:
        self.write.abort()


class MemoryLinks(Links):
    """Sessions of one client to one server, kept for reuse like ConnPool's sockets."""

    def __init__(
        self, net: MemoryNetwork, address: str, config: ClientConfig, counters: NodeCounters
    ) -> None:
        self.net, self.address, self.config = net, address, config
        self.transport = MemoryTransport(counters)
        self._idle: list[MemorySession] = []
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0  # sessions opened (a test can see reuse)

    def lend(self, deadline: float) -> Link:
        with self._lock:
            session = self._idle.pop() if self._idle else None
        if session is None:
            session = MemorySession(self.net, self.address, self.config.token)
            self.opened += 1
            self.last_transport = self.transport.name
        return Link(session, self.transport)

    def give_back(self, link: Link) -> None:
        session = link.conn
        with self._lock:
            if session.usable and not self._closed:
                self._idle.append(session)

    def settle(self, deadline: float) -> None:
        """Nothing is ever owed: reads are reported as they happen."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._idle = []
