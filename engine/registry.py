"""Serving processes in etcd: a server's record under its lease, and a router's view.

Key layout (beside the store's directory, same cluster prefix)::

    /kvstore/<cluster>/workers/<worker_id>        ``kvstore worker`` (its own HTTP API)
    /kvstore/<cluster>/vllm-servers/<server_id>   ``vllm serve`` whose kvstore connector
                                                  has ``"register": true`` (OpenAI API)

Both hold a WorkerRecord (JSON) under the process's lease, written and followed by the
same two classes; the two prefixes keep each router to the servers that speak its API
(``kvstore router`` -> workers, ``kvstore vllm-router`` -> vLLM servers).

A worker registers once (:class:`WorkerRegistration`) and rewrites its record as its
load changes, at most every ``min_interval_s`` and only when it changed, always under
the same lease: when the worker dies its keepalive stops and the record vanishes with
the lease, so a router never routes to a worker gone for longer than the TTL.

The router keeps :class:`WorkerView`, a dict of live records fed by one etcd watch
(list at revision R, watch from R+1; any watch failure re-lists), read synchronously
from the request path: choosing a worker never costs an etcd round trip.

etcd's credentials and TLS (``KVSTORE_ETCD_USER``/``_PASSWORD``/``_CA``/``_CERT``/``_KEY``,
kvstore/config.py EtcdAccess) are read from the environment, as the store clients of the
same process read theirs, unless given; kvstore/directory/etcd_client.py opens the
channel. aetcd's errors stay inside this module: callers see records or kvstore errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.codec.registry import normalize_codec
from kvstore.config import ClusterConfig, EtcdAccess, EtcdAuth, resolve_config
from kvstore.errors import ConfigError, DirectoryError, Unavailable
from kvstore.layout import KVLayout

__all__ = [
    "resolve_directory",
    "ROLES",
    "store_units",
    "vllm_servers_prefix",
    "codec_label",
    "WorkerLoad",
    "WorkerRecord",
    "WorkerRegistration",
    "WorkerView",
    "host_id",
    "workers_prefix",
]

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


def codec_label(name: str | None) -> str:
    """A KV codec's canonical name, ``none`` for uncompressed (ConfigError if unknown):
    how records, flags and the router's answers spell it."""
    return normalize_codec(name) or "none"


def workers_prefix(cluster: str) -> bytes:
    """Every worker record of a cluster lives under this."""
    return f"/kvstore/{cluster}/workers/".encode()


def vllm_servers_prefix(cluster: str) -> bytes:
    """Every registered ``vllm serve`` of a cluster lives under this."""
    return f"/kvstore/{cluster}/vllm-servers/".encode()


def host_id() -> str:
    """The kernel's boot id: equal for two processes exactly when they share a host
    (the same test the store's clients use to pick shared memory); "" when unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker reports about its load; the router adds what it sent since."""

    queued_tokens: int = 0  # prompt tokens accepted and not yet prefilled
    running: int = 0  # requests in progress (prefills and decodes)
    free_kv_tokens: int = 0  # KV capacity left for new decodes, in tokens
    kv_capacity_tokens: int = 0
    done: int = 0  # prefills finished since start: tells a router whether this is stale


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A serving worker as the router sees it. ``address`` is its HTTP base URL.

    ``store_node`` is the id of the store node beside it (where its prefills write
    and read their prefix); ``zone`` a topology label (rack, zone) for placement.
    ``prefill_coeffs`` is its fitted prefill time model (see engine/planning/scheduler.py),
    measured at start on its own model and hardware, or None.

    ``kv_codec`` is how its blocks are stored (``none``, ``int8``, ``fp8``; see
    kvstore/codec/): a decode worker can read a prefill worker's handoff only if both
    store the same codec's bytes, so the router pairs workers by it. It is also part
    of ``namespace``'s layout (``:Cint8``); a record whose two disagree is refused as
    malformed, and a record from before the field existed is uncompressed, as its
    layout says.
    """

    worker_id: str
    role: str
    model: str
    address: str
    namespace: dict[str, str]
    store_node: str = ""
    host: str = field(default_factory=socket.gethostname)
    host_id: str = field(default_factory=host_id)
    zone: str = ""
    block_tokens: int = 16
    max_context: int = 2048
    kv_bytes_per_token: int = 0
    prefill_coeffs: tuple[float, float, float] | None = None
    load: WorkerLoad = field(default_factory=WorkerLoad)
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_codec: str = "none"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role {self.role!r}: choose one of {', '.join(ROLES)}")
        if self.kv_codec != codec_label(self.kv_codec):
            raise ConfigError(f"kv_codec {self.kv_codec!r}: use its canonical name")
        layout = self.namespace.get("layout")
        if layout is not None and codec_label(KVLayout.parse(layout).codec) != self.kv_codec:
            raise ConfigError(f"kv_codec {self.kv_codec!r} disagrees with layout {layout!r}")

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WorkerRecord:
        try:
            d = json.loads(raw)
            d["load"] = WorkerLoad(**d.get("load", {}))
            if d.get("prefill_coeffs") is not None:
                d["prefill_coeffs"] = tuple(float(c) for c in d["prefill_coeffs"])
            return cls(**d)
        except (ValueError, TypeError, KeyError, ConfigError) as exc:
            raise DirectoryError(f"malformed worker record: {raw[:200]!r}") from exc


def _cancelling() -> bool:
    from kvstore.directory.etcd_client import cancelling  # aetcd is optional

    return cancelling()


def _auth(auth: EtcdAuth | None) -> EtcdAuth:
    """``auth``, or the ``KVSTORE_ETCD_*`` settings when None."""
    if auth is not None:
        return auth
    access: EtcdAccess = resolve_config(EtcdAccess)
    return access.etcd_auth


async def _client(endpoint: str, auth: EtcdAuth, prefix: bytes) -> Any:
    from kvstore.directory.etcd import translate  # aetcd is optional
    from kvstore.directory.etcd_client import etcd_client

    client = etcd_client(endpoint, auth)
    try:
        await client.connect()
        await client.get(prefix)  # fail fast if etcd is down or refuses us
    except Exception as exc:
        with contextlib.suppress(Exception):
            await client.close()
        raise translate(exc, f"{endpoint} connect") from exc
    return client


class WorkerRegistration:
    """A worker's record in etcd under its own lease, kept alive and kept current.

    Lifecycle: ``await start(record)`` (grants the lease, writes the record, starts
    the keepalive task) -> ``update_load(load)`` any number of times, from the event
    loop -> ``await stop()`` (revokes the lease: the record vanishes at once). If the
    lease is lost (etcd down past the TTL), the next keepalive registers again under
    a new lease.
    """

    def __init__(
        self,
        endpoint: str,
        cluster: str,
        *,
        ttl: int = 10,
        min_interval_s: float = 0.2,
        auth: EtcdAuth | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self.endpoint, self.cluster, self.auth = endpoint, cluster, _auth(auth)
        self.ttl, self.min_interval_s = ttl, min_interval_s
        self.prefix = workers_prefix(cluster) if prefix is None else prefix
        self._client: Any = None
        self._lease: Any = None
        self._record: WorkerRecord | None = None
        self._written: WorkerRecord | None = None
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> bytes:
        assert self._record is not None
        return self.prefix + self._record.worker_id.encode()

    async def connect(self) -> None:
        """Reach etcd (raises Unavailable when it cannot): ``start`` does it when not
        done before, so a caller may check etcd first and write its record later."""
        if self._client is None:
            self._client = await _client(self.endpoint, self.auth, self.prefix)

    async def start(self, record: WorkerRecord) -> None:
        self._record = record
        await self.connect()
        await self._register()
        self._task = asyncio.create_task(self._run(), name="worker-registration")

    async def _register(self) -> None:
        assert self._record is not None
        self._lease = await self._client.lease(self.ttl)
        await self._client.put(self.key, self._record.to_json(), lease=self._lease)
        self._written = self._record

    def update_load(self, load: WorkerLoad) -> None:
        """Record the current load; written by the background task (coalesced)."""
        assert self._record is not None
        if load != self._record.load:
            self._record = replace(self._record, load=load)
            self._dirty.set()

    async def _run(self) -> None:
        every = max(self.ttl / 3.0, 0.5)
        loop = asyncio.get_running_loop()
        next_ka = loop.time() + every
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), max(next_ka - loop.time(), 0.01))
            try:
                if loop.time() >= next_ka:
                    next_ka = loop.time() + every
                    reply = await self._lease.refresh()
                    if reply is None or reply.TTL <= 0:
                        log.warning("worker lease lost; registering again")
                        await self._register()
                if self._dirty.is_set() and self._record != self._written:
                    self._dirty.clear()
                    rec = self._record
                    assert rec is not None
                    await self._client.put(self.key, rec.to_json(), lease=self._lease)
                    self._written = rec
                    await asyncio.sleep(self.min_interval_s)  # coalesce bursts of changes
                else:
                    self._dirty.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away: keep serving, try again next round
                if _cancelling():  # grpc reports a cancellation as an RPC error
                    raise asyncio.CancelledError from exc
                log.warning("worker registration: %s", exc)
                await asyncio.sleep(min(every, 1.0))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None


class WorkerView:
    """The router's live copy of every worker record, fed by one etcd watch.

    Concurrency: written only by the feed task on the router's event loop; reads
    (:meth:`workers`) return the current dict, replaced whole on a re-list and
    mutated key by key by the watch, all on that same loop.
    """

    def __init__(
        self,
        endpoint: str,
        cluster: str,
        *,
        retry_s: float = 0.5,
        auth: EtcdAuth | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self.endpoint, self.cluster, self.retry_s = endpoint, cluster, retry_s
        self.auth = _auth(auth)
        self.prefix = workers_prefix(cluster) if prefix is None else prefix
        self._workers: dict[str, WorkerRecord] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self.relists = 0

    def workers(self) -> dict[str, WorkerRecord]:
        """Live workers by id (do not mutate)."""
        return self._workers

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every change (on the event loop)."""
        self._listeners.append(fn)

    async def start(self, timeout: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name="worker-view")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            raise Unavailable(f"etcd {self.endpoint}: worker list not loaded in time") from None

    async def wait_for(
        self, predicate: Callable[[dict[str, WorkerRecord]], bool], timeout: float
    ) -> bool:
        """Wait until ``predicate(workers)`` holds (tests, start-up); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self._workers):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _run(self) -> None:
        prefix = self.prefix
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        while True:
            client = None
            try:
                client = await _client(self.endpoint, self.auth, prefix)
                got = await client.get_prefix(prefix)
                fresh: dict[str, WorkerRecord] = {}
                for kv in got:
                    self._add(fresh, kv.value)
                self._workers = fresh
                self.relists += 1
                self._ready.set()
                self._changed()
                watch = await client.watch_prefix(
                    prefix, range_end=end, start_revision=got.header.revision + 1
                )
                async for ev in watch:
                    self._apply(ev)
                    self._changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _cancelling():  # grpc reports a cancellation as an RPC error
                    raise asyncio.CancelledError from exc
                log.warning("worker view: %s; listing again", exc)
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        await client.close()
            await asyncio.sleep(self.retry_s)

    def _apply(self, ev: Any) -> None:
        import aetcd

        wid = ev.kv.key.decode().rsplit("/", 1)[-1]
        if ev.kind == aetcd.EventKind.DELETE:
            self._workers.pop(wid, None)
        else:
            self._add(self._workers, ev.kv.value)

    @staticmethod
    def _add(into: dict[str, WorkerRecord], raw: bytes) -> None:
        try:
            rec = WorkerRecord.from_json(raw)
        except DirectoryError as exc:
            log.warning("%s", exc)
            return
        into[rec.worker_id] = rec

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def store_units(endpoint: str, cluster: str, auth: EtcdAuth | None = None) -> dict[str, str]:
    """The store nodes registered in the cluster's directory: write unit (a node id, or
    a sharded node's group) -> the address a client dials. One etcd read, no mirror:
    a server finds the node beside it, a router the node a server names."""
    from kvstore.client.groups import unit_addresses
    from kvstore.directory.etcd import EtcdDirectory  # aetcd is optional

    directory = EtcdDirectory(endpoint, cluster, auth=_auth(auth))
    await directory.open()
    try:
        nodes = await directory.list_nodes()
    finally:
        await directory.close()
    return unit_addresses({n.node_id: n for n in nodes})


def resolve_directory(args: Any) -> Any:
    """Fill ``args.etcd`` / ``args.cluster`` from flags, then ``KVSTORE_ETCD`` /
    ``KVSTORE_CLUSTER``, then the defaults (kvstore/config.py reads the environment).
    The etcd credentials are checked here too, so a bad one fails at start."""
    cfg = resolve_config(ClusterConfig, flags={"etcd": args.etcd, "cluster": args.cluster})
    args.etcd, args.cluster = cfg.etcd, cfg.cluster
    return args
