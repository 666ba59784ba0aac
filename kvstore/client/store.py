"""Python SDK: :class:`StoreClient` (blocking) and :class:`AsyncStoreClient` (asyncio).

There is one implementation, and it is the blocking one; AsyncStoreClient runs it on a
private thread pool. Measured on this project's 2-core hosts, a blocking socket round
trip costs ~25 us where an asyncio one costs 55-175 us, and handing a call to an event
loop thread costs ~60 us: for a 1 MiB shared-memory get (~200 us end to end) an
async-first core would cost every synchronous caller a third of its bandwidth. Blocking socket
I/O and numpy copies release the GIL, so the async facade's threads run in parallel.

Paths: control calls (remove, stats, evict, drain, health, connect-time Info) use gRPC,
which carries no gets or puts; gets, puts and the hot metadata calls (exists,
match_prefix) use a pooled data socket, the one data plane, whose transport is shared
memory when the server is on this host and TCP otherwise.

Lifecycle (kvstore/client/base.py): a client is unopened, open or closed.
``StoreClient.connect(...)`` returns an open client; ``with StoreClient(...) as c`` opens
on entry and closes on exit. Any call on an unopened or closed client raises
ClosedError saying which.

Errors: only the kvstore error tree (kvstore/errors.py). A failure whose ``retryable`` is
true (server unreachable, connection reset, deadline of one attempt, no capacity) is
retried with jittered exponential backoff, ``retries`` times, within the call's
timeout; others are raised at once. Batch calls report each key's own outcome; a
write's keys whose outcome is a retryable error (a node momentarily full while other
writers' blocks are on their way to SSD) are sent again, alone, the same way. (A read's
are not: a cluster client reads that key from another replica instead.)
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self, TypeVar

from google.protobuf.json_format import MessageToDict

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import layer_range
from kvstore.client.base import ClientBase, ClientState, one
from kvstore.client.connector import Connector, SocketConnector
from kvstore.client.control import Control
from kvstore.client.faults import FaultyConnector
from kvstore.client.layered import AsyncLayeredPut, LayeredPut, LinkLayeredPut, block_info
from kvstore.client.transport.base import LayerSink, Link, Links, Transport
from kvstore.config import ClientConfig
from kvstore.copies.caller import with_caller
from kvstore.errors import (
    BlockTooLarge,
    ConfigError,
    InvalidValue,
    KVStoreError,
    LimitExceeded,
)
from kvstore.faults import FaultPlan
from kvstore.keys import Namespace
from kvstore.observe.counters import NodeCounters
from kvstore.wire.codec import scope_of, stats_from_proto

__all__ = ["AsyncNodeClient", "NodeClient"]

T = TypeVar("T")
DataCall = Callable[[Any, Transport[Any], float], T]  # (connection, transport, deadline)
DEFAULT_PORT = 7400


def _split_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` (port 7400) -> (host, port)."""
    host, port = address, DEFAULT_PORT
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), address)
    elif address.count(":") == 1:
        host, p = address.split(":")
        port = _port(p, address)
    if not host or "/" in host:
        raise ConfigError(f"address {address!r}: expected host:port, e.g. 127.0.0.1:7400")
    return host, port


def _port(text: str, address: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"address {address!r}: bad port {text!r}")
    return int(text)


def _pick(seq: Sequence[Any], idx: list[int]) -> Sequence[Any]:
    """``seq`` at positions ``idx`` (``seq`` itself when that is all of it)."""
    return seq if len(idx) == len(seq) else [seq[i] for i in idx]


class NodeClient(ClientBase):
    """Blocking client of one store server. Thread-safe."""

    _name = "StoreClient"
    _open_with = "StoreClient.connect(...) or 'with StoreClient(...)'"

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        namespace: Namespace | None = None,
        config: ClientConfig | None = None,
        connector: Connector | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.config = ClientConfig.resolve(config, token, **overrides)
        connector = connector if connector is not None else SocketConnector()
        if self.config.faults:  # a fault drill: the plan is this client's own
            connector = FaultyConnector(connector, FaultPlan.parse(self.config.faults))
        self.connector = connector
        self.address = address
        self.host, self.port = _split_address(address)
        self.namespace = namespace
        self._scope = scope_of(namespace)
        self.counters = NodeCounters()  # retries, corrupt_transfers, shm_lease_expired
        self._lock = threading.Lock()
        self._control: Control | None = None
        self._pool: Links | None = None
        self._info = pb.InfoResponse()

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def connect(cls, address: str, **kwargs: Any) -> Self:
        """An open client (same arguments as the constructor)."""
        return cls(address, **kwargs).open()

    def open(self) -> Self:
        """Reach the server (Info over gRPC) and set up the data-socket pool.

        Retries an unreachable server until ``connect_timeout_s``; a refused token is
        an AuthError at once. Opening an open client does nothing.
        """
        with self._lock:
            if self._already_open():
                return self
            control = self.connector.control(self.host, self.port, self.config)
            try:
                deadline = time.monotonic() + self.config.connect_timeout_s
                self._info = self._retry(
                    lambda d: control.call("Info", pb.InfoRequest(), d, wait=False),
                    deadline,
                    until_deadline=True,
                )
                self._pool = self.connector.links(
                    self.host, self.config, self.counters, self._locate, self._info
                )
                self._opened()
            except BaseException:
                if self._pool is not None:
                    self._pool.close()
                    self._pool = None
                control.close()
                raise
            self._control = control
            self._state = ClientState.OPEN
        return self

    def _opened(self) -> None:
        """Called by :meth:`open` once the server answered, under the client's lock and
        before any call can run: a subclass sets up what its calls need (StoreClient:
        the shards of a sharded node, kvstore/client/api.py). No I/O here."""

    def close(self) -> None:
        """Close connections and unmap the server's segment; idempotent."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
            if self._control is not None:
                self._control.close()
            self._pool = self._control = None
            self._state = ClientState.CLOSED

    @property
    def server_info(self) -> dict[str, Any]:
        """What the server said at connect time (node, tenant, limits, locality)."""
        return MessageToDict(self._info, preserving_proto_field_name=True)

    @property
    def transport(self) -> str:
        """The transport of the latest data connection (``shm`` or ``tcp``; "" before one)."""
        return self._pool.last_transport if self._pool is not None else ""

    def wait_prefaulted(self, timeout: float | None = 30.0) -> bool:
        """Wait until the node's shared segment, once mapped by a same-host call, is
        prefaulted in this process (ClientConfig.shm_prefault_bytes); True when it is
        (or nothing is mapped). An engine calls it at start-up so that its first puts
        do not pay a page fault per 4 KiB; calls made meanwhile work, only slower."""
        self._check_open()
        return self._pool.prefaulted(timeout) if self._pool is not None else True

    # -- data ------------------------------------------------------------------------------

    # ``namespace=`` on a data call overrides the client's default for that call (the
    # tenant part is still fixed by the server from the token); StoreNode takes the same
    # keyword, so engine code runs against either.

    def put(
        self,
        key: bytes,
        value: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Store one block (torch tensor, numpy array or bytes); False if already stored."""
        return bool(one(self.batch_put([key], [value], namespace=namespace, timeout=timeout)))

    def get(
        self, key: bytes, *, namespace: Namespace | None = None, timeout: float | None = None
    ) -> Any:
        """A new value of the stored kind, or None on a miss."""
        return one(self.batch_get([key], namespace=namespace, timeout=timeout))

    def get_into(
        self,
        key: bytes,
        out: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        """Copy a block into a preallocated tensor/array of the stored dtype and size
        (``layers=(a, b)``: only layers [a, b) of it, ``out`` sized for them).

        False on a miss (``out`` may then hold partial bytes). No intermediate copy.
        """
        res = self.batch_get_into([key], [out], namespace=namespace, timeout=timeout, layers=layers)
        return bool(one(res))

    def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[bool | KVStoreError]:
        """Store each pair: True stored, False already present, or that key's error."""
        ks = self._keys(keys)
        if len(values) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(values)} values")
        scope = self._scope_for(namespace)

        def write(idx: list[int]) -> DataCall[list[Any]]:
            sub_k, sub_v = _pick(ks, idx), _pick(values, idx)
            return lambda c, t, d: t.write(c, sub_k, sub_v, scope, d)

        return self._per_item(write, len(ks), timeout)

    def begin_layers(
        self,
        keys: Sequence[bytes],
        *,
        shape: Sequence[int],
        dtype: Any,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> LayeredPut:
        """Start a layer-by-layer write of blocks of ``shape`` and ``dtype`` (the layer
        is the first dimension): write each layer range as it is computed, then commit
        (kvstore/client/layered.py has the contract). ``timeout`` bounds each step."""
        ks = self._keys(keys)
        info = block_info(shape, dtype)
        self._check_open()
        assert self._pool is not None
        limit = self._info.limits.max_value_bytes
        if info.nbytes > limit:
            raise BlockTooLarge(f"blocks of {info.nbytes} bytes exceed max_value_bytes {limit}")
        scope = self._scope_for(namespace)
        layers = info.shape[0]

        pool = self._pool

        def attempt(deadline: float) -> tuple[Link, LayerSink]:
            link = pool.lend(deadline)
            try:
                conn, transport = link
                sink = transport.begin_layers(conn, ks, [info] * len(ks), layers, scope, deadline)
            except BaseException:
                pool.give_back(link)  # a broken one is closed: the retry opens another
                raise
            return link, sink

        t = self.config.timeout_s if timeout is None else timeout
        link, sink = self._retry(attempt, time.monotonic() + t)  # nothing sent yet: safe
        return LinkLayeredPut(pool, ks, info, link, sink, t)

    def batch_get(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """New values: each a value, None (miss) or that key's error."""
        ks = self._keys(keys)
        scope = self._scope_for(namespace)
        return self._data(lambda c, t, d: t.read(c, ks, None, scope, d), timeout)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[bool | KVStoreError]:
        """get_into for each pair: True hit, False miss, or that key's error.
        ``layers=(a, b)``: layers [a, b) of each block (the first dimension of its
        shape), each ``out`` sized for them: for layer-wise loading, where layer 0's
        compute starts before the last layer has arrived. A range is verified before it
        is handed over: on the socket against the server's checksum of exactly those
        bytes, from shared memory as the block it belongs to (``verify_shm``)."""
        ks = self._keys(keys)
        if len(outs) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(outs)} outputs")
        scope = self._scope_for(namespace)
        span = layer_range(layers)
        return self._data(lambda c, t, d: t.read(c, ks, outs, scope, d, span), timeout)

    def _scope_for(self, namespace: Namespace | None) -> Any:
        return self._scope if namespace is None else scope_of(namespace)

    # -- metadata -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key is stored (any tier)."""
        ks = self._keys(keys)
        return self._data(lambda c, t, d: t.exists(c, ks, d), timeout)

    def match_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading keys are stored: the reusable prefix, in blocks."""
        ks = self._keys(keys)
        return self._data(lambda c, t, d: t.match_prefix(c, ks, d), timeout)

    def remove(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove blocks; returns how many were present."""
        req = pb.KeysRequest(keys=self._keys(keys))
        return int(self._rpc("Remove", req, timeout).removed)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Node stats (tiers, counters) plus server counters under ``"server"``.

        Reads this client served from the published index are reported first, so the
        counters include everything it read before the call."""
        self._check_open()
        if self._pool is not None:
            self._pool.settle(self._deadline(timeout))
        return stats_from_proto(self._rpc("Stats", pb.StatsRequest(), timeout))

    def health(self, *, timeout: float | None = None) -> str:
        """``serving`` or ``draining``."""
        resp = self._rpc("Health", pb.HealthRequest(), timeout)
        return str(pb.HealthResponse.ServingStatus.Name(resp.status)).lower()

    def set_draining(self, draining: bool = True, *, timeout: float | None = None) -> bool:
        """Admin: make the server refuse new writes (or accept them again)."""
        return bool(self._rpc("Drain", pb.DrainRequest(draining=draining), timeout).draining)

    def control(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """One control-plane RPC by name (``"Scan"``, ``pb.ScanRequest(...)``), with this
        client's retries and deadline: the seam admin tooling (kvstore/client/admin.py)
        builds on without the data-path API growing admin calls."""
        return self._rpc(method, request, timeout)

    # -- machinery ----------------------------------------------------------------------

    def _keys(self, keys: Sequence[bytes]) -> list[bytes]:
        ks = self._as_keys(keys)
        limit = self._info.limits.max_batch
        if limit and len(ks) > limit:
            raise LimitExceeded(f"{len(ks)} keys in one call; the server's max_batch is {limit}")
        return ks

    def _data(self, fn: DataCall[T], timeout: float | None) -> T:
        return self._data_until(fn, self._deadline(timeout))

    def _data_until(self, fn: DataCall[T], deadline: float) -> T:
        self._check_open()
        pool = self._pool
        assert pool is not None

        def attempt(deadline: float) -> T:
            link = pool.lend(deadline)
            try:
                return fn(link.conn, link.transport, deadline)
            finally:
                pool.give_back(link)

        return self._retry(attempt, deadline)

    def _per_item(
        self, call: Callable[[list[int]], DataCall[list[Any]]], n: int, timeout: float | None
    ) -> list[Any]:
        """A batch call whose keys failing with a retryable error are sent again (only
        they), with backoff, ``retries`` times within the call's deadline. A retry that
        fails as a whole leaves those keys their earlier errors: the keys done stay done."""
        deadline = self._deadline(timeout)
        idx = list(range(n))
        results = self._data_until(call(idx), deadline)
        for tries in range(1, self.config.retries + 1):
            idx = [i for i in idx if isinstance(results[i], KVStoreError) and results[i].retryable]
            left = deadline - time.monotonic()
            if not idx or left <= 0:
                break
            self.counters.inc("item_retries", len(idx))
            time.sleep(min(self._backoff(tries), left))
            try:
                again = self._data_until(call(idx), deadline)
            except KVStoreError:
                break
            for i, r in zip(idx, again, strict=True):
                results[i] = r
        return results

    def _backoff(self, tries: int) -> float:
        return min(self.config.backoff_s * 2 ** (tries - 1) * (0.5 + random.random()), 1.0)

    def _rpc(self, method: str, request: Any, timeout: float | None) -> Any:
        self._check_open()
        control = self._control
        assert control is not None
        return self._retry(lambda d: control.call(method, request, d), self._deadline(timeout))

    def _locate(self, deadline: float) -> pb.InfoResponse:
        """Where the data sockets listen (asked again after a connection is refused)."""
        assert self._control is not None
        self._info = self._control.call("Info", pb.InfoRequest(), deadline)
        return self._info

    def _retry(
        self, attempt: Callable[[float], T], deadline: float, *, until_deadline: bool = False
    ) -> T:
        """Run ``attempt`` until it succeeds, fails for good, or time or tries run out."""
        tries = 0
        while True:
            try:
                return attempt(deadline)
            except KVStoreError as exc:
                tries += 1
                left = deadline - time.monotonic()
                if not exc.retryable or left <= 0:
                    raise
                if not until_deadline and tries > self.config.retries:
                    raise
                self.counters.inc("retries")
                time.sleep(min(self._backoff(tries), left))


class AsyncNodeClient:
    """asyncio facade of :class:`StoreClient` (or of a cluster's ClusterClient, see
    :meth:`from_etcd`): each call runs on a private thread pool.

    Same arguments, methods and errors as the client it wraps, as coroutines. Cancelling
    a call stops the wait, not the transfer already under way (it ends at its own
    deadline).
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._wrap(NodeClient(address, **kwargs))

    def _wrap(self, sync: Any) -> None:
        self.sync = sync
        self._pool = ThreadPoolExecutor(sync.config.pool_size, thread_name_prefix="kvstore-client")

    @classmethod
    async def connect(cls, address: str, **kwargs: Any) -> Self:
        """An open client."""
        return await cls(address, **kwargs).open()

    async def open(self) -> Self:
        """See :meth:`StoreClient.open`."""
        await self._run(self.sync.open, check=False)
        return self

    async def close(self) -> None:
        """See :meth:`StoreClient.close`; idempotent."""
        if self.sync.state != ClientState.CLOSED.value:
            await self._run(self.sync.close, check=False)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def state(self) -> str:
        """``unopened``, ``open`` or ``closed``."""
        return self.sync.state

    async def _run(self, fn: Callable[..., T], *args: Any, check: bool = True, **kw: Any) -> T:
        if check:
            self.sync._check_open()
        loop = asyncio.get_running_loop()
        call = with_caller(functools.partial(fn, *args, **kw))  # copies after its work
        return await loop.run_in_executor(self._pool, call)

    async def begin_layers(
        self,
        keys: Sequence[bytes],
        *,
        shape: Sequence[int],
        dtype: Any,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> AsyncLayeredPut:
        """See :meth:`StoreClient.begin_layers`; its steps are coroutines
        (kvstore/client/layered.py, AsyncLayeredPut)."""
        kw = _kw(namespace, timeout)
        put = await self._run(self.sync.begin_layers, keys, shape=shape, dtype=dtype, **kw)
        return AsyncLayeredPut(put, functools.partial(self._run, check=False))

    async def put(
        self,
        key: bytes,
        value: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> bool:
        return await self._run(self.sync.put, key, value, **_kw(namespace, timeout))

    async def get(
        self, key: bytes, *, namespace: Namespace | None = None, timeout: float | None = None
    ) -> Any:
        return await self._run(self.sync.get, key, **_kw(namespace, timeout))

    async def get_into(
        self,
        key: bytes,
        out: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        kw = _kw(namespace, timeout)
        return await self._run(self.sync.get_into, key, out, layers=layers, **kw)

    async def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[bool | KVStoreError]:
        return await self._run(self.sync.batch_put, keys, values, **_kw(namespace, timeout))

    async def batch_get(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        return await self._run(self.sync.batch_get, keys, **_kw(namespace, timeout))

    async def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[bool | KVStoreError]:
        kw = _kw(namespace, timeout)
        return await self._run(self.sync.batch_get_into, keys, outs, layers=layers, **kw)

    async def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        return await self._run(self.sync.exists, keys, timeout=timeout)

    async def match_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return await self._run(self.sync.match_prefix, keys, timeout=timeout)

    async def remove(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return await self._run(self.sync.remove, keys, timeout=timeout)

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._run(self.sync.stats, timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> str:
        return await self._run(self.sync.health, timeout=timeout)

    async def set_draining(self, draining: bool = True, *, timeout: float | None = None) -> bool:
        return await self._run(self.sync.set_draining, draining, timeout=timeout)

    async def control(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """See :meth:`StoreClient.control`."""
        return await self._run(self.sync.control, method, request, timeout=timeout)


def _kw(namespace: Namespace | None, timeout: float | None) -> dict[str, Any]:
    """Keyword arguments of a data call; ``namespace`` only when given (a cluster
    client's calls take none)."""
    if namespace is None:
        return {"timeout": timeout}
    return {"namespace": namespace, "timeout": timeout}
