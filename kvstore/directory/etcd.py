"""The directory on a real etcd (3.4+), through aetcd's channel and stubs.

Key layout (``<c>`` the cluster name, ``<hex>`` the 32 hex digits of a block key)::

    /kvstore/<c>/nodes/<node>          NodeInfo JSON            under the node's lease
    /kvstore/<c>/blocks/<hex>/<node>   b"<t><size>", t in h|d|s  under the same lease

Block values are tiny ASCII (``d1048576``: DRAM, 1 MiB) so a million entries list
fast and stay readable with ``etcdctl get``. A key's replicas are adjacent in key
order, and one lease per node makes a dead node's entries vanish in one revision.

Writes are transactions of at most 128 ops and well under 1.5 MiB, a few in flight
at once (each key appears once per flush, so they cannot reorder a key's history).

Readers keep a :class:`Mirror` fed by one watch (:class:`_WatchFeed`): a paged range
at revision R, then a watch from R+1. A dropped stream (etcd restart, network) is
resumed from the last applied revision when etcd still has that history and is the
same cluster; a compaction past it (reported by the watch) or a different cluster id
forces a full re-list, swapped in atomically. A guard beside the watch re-lists when
etcd compacted past the mirror without the watch saying so: etcd 3.4 (Debian's
3.4.23 among them) can leave a slow watcher that a compaction passes neither fed nor
cancelled (etcd-io/etcd#17529), and a mirror must not sit on a wedged stream.

With ``auth`` (:class:`~kvstore.config.EtcdAuth`) the channel is TLS and/or carries
etcd's auth token (kvstore/directory/etcd_client.py). An etcd that refuses the
credentials, or a call without them, is an AuthError naming the cause; a user whose
role does not cover the cluster's prefix gets PermissionDenied.

aetcd and grpc errors are translated into kvstore.errors here and nowhere else.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc

from kvstore.config import EtcdAuth
from kvstore.directory.base import NodeInfo
from kvstore.directory.etcd_client import cancelling, etcd_client
from kvstore.directory.mirror import (
    DEL_BLOCK,
    DEL_NODE,
    PUT_BLOCK,
    PUT_NODE,
    Mirror,
    MirrorSnapshot,
    Op,
)
from kvstore.directory.registration import LeasedDirectory, WriteOp
from kvstore.errors import (
    AuthError,
    ConfigError,
    DirectoryError,
    KVStoreError,
    LeaseExpired,
    PermissionDenied,
    TimeoutError_,
    Unavailable,
)
from kvstore.tier_kinds import TierKind

__all__ = ["EtcdDirectory", "block_key", "cluster_prefix", "node_key", "translate"]

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
MAX_TXN_BYTES = 1 << 20  # etcd refuses requests over 1.5 MiB; stay well below
_CHANNEL_OPTIONS = {
    "grpc.max_receive_message_length": 64 << 20,
    "grpc.max_send_message_length": 8 << 20,
    "grpc.keepalive_time_ms": 10_000,  # etcd's --grpc-keepalive-min-time is 5 s
    "grpc.keepalive_timeout_ms": 5_000,
}
_TIER_CODE = {TierKind.HBM: b"h", TierKind.DRAM: b"d", TierKind.SSD: b"s"}
_CODE_TIER = {code[0]: tier for tier, code in _TIER_CODE.items()}
_HEX = 32  # hex digits of a 16-byte block key


def cluster_prefix(cluster: str) -> bytes:
    """Every key of a cluster starts with this."""
    return f"/kvstore/{cluster}/".encode()


def node_key(cluster: str, node_id: str) -> bytes:
    """Where a node's record lives."""
    return cluster_prefix(cluster) + b"nodes/" + node_id.encode()


def block_key(cluster: str, key: bytes, node_id: str) -> bytes:
    """Where one node's entry for one block lives."""
    return cluster_prefix(cluster) + b"blocks/" + binascii.hexlify(key) + b"/" + node_id.encode()


def _range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])  # prefixes end in "/", never 0xff


class _Compacted(DirectoryError):
    """The revision a reader needs is gone: re-list (never leaves this module)."""


def translate(exc: BaseException, what: str) -> KVStoreError:
    """One foreign error -> the kvstore error a caller can act on (also for the serving
    registry's aetcd calls, engine/registry.py: one mapping for both)."""
    cause: BaseException = exc
    if isinstance(exc, aetcd.exceptions.ClientError) and isinstance(exc.__cause__, grpc.RpcError):
        cause = exc.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        code, details = cause.code(), cause.details() or ""
        msg = f"etcd {what}: {details}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return Unavailable(msg)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError_(msg)
        if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
            return LeaseExpired(msg)
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return _Compacted(msg)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(msg)
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return PermissionDenied(f"{msg} (does the user's role cover the cluster prefix?)")
        if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in details:
            return AuthError(f"{msg}: etcd has auth enabled; set etcd_user and etcd_password")
        if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
            return AuthError(f"{msg}: check etcd_user and etcd_password")
        if code == grpc.StatusCode.FAILED_PRECONDITION and "auth" in details:
            return AuthError(f"{msg}: etcd_user is set but this etcd does not use auth")
        return DirectoryError(f"{msg} ({code.name})")
    if isinstance(exc, aetcd.exceptions.RevisionCompactedError):
        return _Compacted(f"etcd {what}: {exc}")
    if isinstance(exc, aetcd.exceptions.ConnectionFailedError):
        return Unavailable(f"etcd {what}: {exc}")
    if isinstance(exc, aetcd.exceptions.ConnectionTimeoutError | asyncio.TimeoutError):
        return TimeoutError_(f"etcd {what}: timed out")
    return DirectoryError(f"etcd {what}: {exc!r}")


@contextlib.contextmanager
def _etcd_errors(what: str) -> Iterator[None]:
    """Translate aetcd/grpc failures raised inside the block (cancellation passes)."""
    try:
        yield
    except KVStoreError:
        raise
    except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError) as exc:
        if cancelling():  # a cancellation grpc reported as an RPC error: keep it one
            raise asyncio.CancelledError from exc
        raise translate(exc, what) from exc


def _build_txns(head: bytes, tail: bytes, lease: int, ops: list[WriteOp]) -> list[rpc.TxnRequest]:
    """Encode block writes as transactions of <= MAX_TXN_OPS ops and <= MAX_TXN_BYTES.

    Filled in place through ``success.add()``: building standalone messages and
    copying them in costs three times as much, and this is the publish hot path.
    """
    txns: list[rpc.TxnRequest] = []
    hexlify, code = binascii.hexlify, _TIER_CODE
    txn, n, nbytes = rpc.TxnRequest(), 0, 0
    for key, val in ops:
        k = head + hexlify(key) + tail
        if n >= MAX_TXN_OPS or nbytes + len(k) + 32 > MAX_TXN_BYTES:
            txns.append(txn)
            txn, n, nbytes = rpc.TxnRequest(), 0, 0
        if val is None:
            txn.success.add().request_delete_range.key = k
            nbytes += len(k) + 8
        else:
            put = txn.success.add().request_put
            put.key = k
            put.value = v = code[val[0]] + b"%d" % val[1]
            put.lease = lease
            nbytes += len(k) + len(v) + 24
        n += 1
    if n:
        txns.append(txn)
    return txns


async def _keepalive_reply(
    stub: rpc.LeaseStub, lease: int, timeout: float
) -> rpc.LeaseKeepAliveResponse | None:
    """One LeaseKeepAlive round trip on a stream read to its end (None: no reply).

    Not aetcd's ``refresh_lease``: it returns from inside ``async for`` over the call,
    which leaves the call's response generator suspended and holding the call, a cycle
    that only the cyclic GC frees; until then the call keeps its channel alive after
    ``close()``, socket and all (issue 33). (It would also dial a fresh channel if it
    ran after the client closed.) ``read()`` to EOF leaves no generator suspended, on
    a plain call or one through the auth interceptors (whose ``read()`` makes one).
    """
    call = stub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=timeout)
    try:
        reply = await call.read()
        if reply is not grpc.aio.EOF:
            with contextlib.suppress(grpc.RpcError):  # the reply is what counts
                await call.read()  # EOF at once: etcd ends the stream on our half-close
    finally:
        call.cancel()
    return None if reply is grpc.aio.EOF else reply


class EtcdDirectory(LeasedDirectory):
    """:class:`Directory` on etcd. ``endpoint`` is ``host:port`` of one etcd member;
    ``auth`` its credentials and TLS (None: a plaintext channel, no auth).

    ``timeout`` bounds every unary call; ``max_inflight`` is how many write
    transactions one flush keeps in flight; ``page`` is the re-list page size;
    ``watch_check_s`` is how often the mirror's guard asks etcd whether history was
    compacted past the mirror (one single-key count per check).
    """

    def __init__(
        self,
        endpoint: str = "127.0.0.1:2379",
        cluster: str = "default",
        *,
        auth: EtcdAuth | None = None,
        timeout: float = 5.0,
        max_inflight: int = 4,
        page: int = 10_000,
        watch_check_s: float = 2.0,
    ) -> None:
        super().__init__(cluster)
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {endpoint!r}: expected host:port")
        if max_inflight < 1 or page < 1:
            raise ConfigError("max_inflight and page must be >= 1")
        if not watch_check_s > 0:
            raise ConfigError("watch_check_s must be > 0")
        self._watch_check_s = watch_check_s
        self.endpoint = endpoint
        self._auth = auth
        self._timeout = timeout
        self._max_inflight = max_inflight
        self._page = page
        self._prefix = cluster_prefix(self.cluster)
        self._client: aetcd.Client | None = None
        self._feed: _WatchFeed | None = None

    @property
    def client(self) -> aetcd.Client:
        """The underlying aetcd client (open directories only)."""
        self._check_open()
        assert self._client is not None
        return self._client

    async def _connect(self) -> None:
        self._client = etcd_client(
            self.endpoint, self._auth, timeout=self._timeout, options=_CHANNEL_OPTIONS
        )
        try:
            with _etcd_errors("connect"):
                await self._client.connect()
            await self._range(self._prefix, limit=1, count_only=True)  # fail fast if down
        except BaseException:
            await self._disconnect()  # closes a channel opened before the refusal
            raise

    async def _disconnect(self) -> None:
        feed, self._feed = self._feed, None
        client, self._client = self._client, None
        try:
            if feed is not None:
                await feed.stop()
        finally:  # whatever the feed ended with, the channel (and its socket) goes
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    # -- raw calls -------------------------------------------------------------------------

    async def _range(
        self, key: bytes, end: bytes | None = None, **kw: int | bool
    ) -> rpc.RangeResponse:
        assert self._client is not None
        req = rpc.RangeRequest(key=key, range_end=end or b"", **kw)
        with _etcd_errors("range"):
            return await self._client.kvstub.Range(req, timeout=self._timeout)

    async def _txn(self, req: rpc.TxnRequest, what: str) -> rpc.TxnResponse:
        assert self._client is not None
        with _etcd_errors(what):
            return await self._client.kvstub.Txn(req, timeout=self._timeout)

    # -- primitives ----------------------------------------------------------------------------

    async def _grant(self, ttl: int) -> int:
        assert self._client is not None
        with _etcd_errors("lease grant"):
            resp = await self._client.leasestub.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl, ID=0), timeout=self._timeout
            )
        if resp.error:
            raise DirectoryError(f"etcd lease grant: {resp.error}")
        return int(resp.ID)

    async def _create_node(self, info: NodeInfo, lease: int) -> NodeInfo | None:
        key = node_key(self.cluster, info.node_id)
        req = rpc.TxnRequest(
            compare=[
                rpc.Compare(
                    key=key,
                    target=rpc.Compare.CREATE,
                    result=rpc.Compare.EQUAL,
                    create_revision=0,
                )
            ],
            success=[
                rpc.RequestOp(
                    request_put=rpc.PutRequest(key=key, value=info.to_json(), lease=lease)
                )
            ],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
        )
        for _attempt in range(3):
            resp = await self._txn(req, "register")
            if resp.succeeded:
                return None
            kvs = resp.responses[0].response_range.kvs
            if kvs:
                return NodeInfo.from_json(kvs[0].value, epoch=kvs[0].lease)
        raise DirectoryError(f"register {info.node_id!r}: record flapping, try again")

    async def _update_node(self, info: NodeInfo, lease: int) -> int:
        key = node_key(self.cluster, info.node_id)
        req = rpc.TxnRequest(
            compare=[  # still our record: a newer life holds it under another lease
                rpc.Compare(
                    key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=lease
                )
            ],
            success=[
                rpc.RequestOp(
                    request_put=rpc.PutRequest(key=key, value=info.to_json(), lease=lease)
                )
            ],
        )
        resp = await self._txn(req, "update node")
        if not resp.succeeded:
            raise LeaseExpired(f"node {info.node_id!r}: its record is gone or not under {lease:x}")
        return int(resp.header.revision)

    async def _wait_node_gone(self, node_id: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = node_key(self.cluster, node_id)
        while True:
            resp = await self._range(key, count_only=True)
            if resp.count == 0:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.05, left))

    async def _keepalive_once(self, lease: int) -> bool:
        assert self._client is not None
        # asyncio.timeout, not wait_for: 3.11's wait_for returns the reply and drops a
        # cancellation that arrives as the reply does, and the keepalive task being
        # stopped then runs on (seen after an etcd restart: close() hung 15 s).
        with _etcd_errors("keepalive"):
            async with asyncio.timeout(self._timeout):
                reply = await _keepalive_reply(self._client.leasestub, lease, self._timeout)
        return reply is not None and reply.TTL > 0

    async def _revoke(self, lease: int) -> None:
        assert self._client is not None
        try:
            with _etcd_errors("lease revoke"):
                await self._client.leasestub.LeaseRevoke(
                    rpc.LeaseRevokeRequest(ID=lease), timeout=self._timeout
                )
        except LeaseExpired:
            pass  # already gone: what we wanted

    async def _write(self, node_id: str, lease: int, ops: list[WriteOp]) -> int:
        sem = asyncio.Semaphore(self._max_inflight)

        async def one(txn: rpc.TxnRequest) -> int:
            async with sem:
                resp = await self._txn(txn, "publish")
                return int(resp.header.revision)

        txns = _build_txns(self._prefix + b"blocks/", b"/" + node_id.encode(), lease, ops)
        results = await asyncio.gather(*(one(t) for t in txns), return_exceptions=True)
        revisions = [r for r in results if isinstance(r, int)]
        errors = [r for r in results if isinstance(r, BaseException)]
        results.clear()  # this frame must not hold the failure it raises (see _end_all)
        if errors:  # a lost lease outranks an outage: it decides what the caller does
            first = next((i for i, e in enumerate(errors) if isinstance(e, LeaseExpired)), 0)
            raise errors.pop(first)
        return max(revisions, default=0)

    # -- reads --------------------------------------------------------------------------------

    async def list_nodes(self) -> list[NodeInfo]:
        self._check_open()
        prefix = self._prefix + b"nodes/"
        resp = await self._range(prefix, _range_end(prefix))
        return [NodeInfo.from_json(kv.value, epoch=kv.lease) for kv in resp.kvs]

    async def mirror(self) -> Mirror:
        self._check_open()
        if self._feed is None:
            assert self._client is not None
            self._feed = _WatchFeed(
                self._client, self._prefix, self._range, self._page, self._watch_check_s
            )
            self._feed.start()
        await self._feed.ready(self._timeout)
        return self._feed.mirror

    async def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: now); returns it.

        An admin operation (tests, ``kvstore`` maintenance): watchers behind it re-list.
        """
        self._check_open()
        assert self._client is not None
        if revision is None:
            revision = int((await self._range(self._prefix, count_only=True)).header.revision)
        with _etcd_errors("compact"):
            await self._client.compact(revision, physical=True)
        return revision


RangeFn = Callable[..., Awaitable[rpc.RangeResponse]]


async def _end_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks``, wait for them, and forget them (the list is emptied).

    Why forget: the failure a watch re-raises from one of them carries a traceback
    through the frame that waited on them; a task still named by that frame holds the
    failure, so failure -> traceback -> frame -> task -> failure is a cycle that only
    the cyclic GC frees. Until it runs, the frames in that traceback keep the failed
    watch call, whose gRPC core call keeps its channel alive after ``close()``: a
    socket to etcd outlived every closed client after an etcd restart (issue 33).
    """
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tasks.clear()


class _WatchFeed:
    """One watch over a cluster prefix, feeding one Mirror.

    Concurrency contract: everything here runs on the directory's loop. The feed task
    (``_run`` and the stream reader it starts) is the mirror's only writer; the guard
    task only reads ``_rev``. ``_rev`` is the last revision whose events are all
    applied; ``_leases`` maps node id -> the lease of its live record, used to refuse
    block entries written under any other lease (a stale epoch).
    """

    def __init__(
        self, client: aetcd.Client, prefix: bytes, range_fn: RangeFn, page: int, check_s: float
    ) -> None:
        self.mirror = Mirror()
        self._client = client
        self._prefix = prefix
        self._blocks = prefix + b"blocks/"
        self._nodes = prefix + b"nodes/"
        self._range = range_fn
        self._page = page
        self._check_s = check_s
        self._probe = prefix + b"watch-probe"  # never written: a count over it is one lookup
        self._rev = 0
        self._cluster_id = 0
        self._leases: dict[str, int] = {}
        self._names: dict[bytes, str] = {}
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.resumes = 0
        self.stalls = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstore-directory-watch")

    async def ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except TimeoutError:
            raise Unavailable("directory mirror could not load a first listing") from None

    async def stop(self) -> None:
        """End the feed; how it ended (cancelled, or a failure after an etcd restart)
        no longer matters to anyone."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        relist, check, backoff = True, False, 0.05
        while True:
            try:
                if check:
                    relist = relist or await self._history_lost()
                    check = False
                if relist:
                    await self._relist()
                    relist = False
                backoff = 0.05
                await self._watch()
            except _Compacted as exc:
                log.info("directory watch fell behind a compaction; re-listing (%s)", exc)
                relist = True
            except KVStoreError as exc:
                level = logging.INFO if backoff == 0.05 else logging.DEBUG  # once per outage
                log.log(level, "directory watch interrupted, resuming: %s", exc)
                check = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _history_lost(self) -> bool:
        """After a dropped stream: is this another cluster, or did revisions go back?"""
        resp = await self._range(self._prefix, count_only=True)
        if resp.header.cluster_id != self._cluster_id or resp.header.revision < self._rev:
            log.warning("etcd cluster changed under the directory mirror; re-listing")
            return True
        self.resumes += 1
        return False

    async def _relist(self) -> None:
        snap = MirrorSnapshot()
        leases: dict[str, int] = {}

        def add_node(kv: rpc.KeyValue) -> None:
            try:
                info = NodeInfo.from_json(kv.value, epoch=kv.lease)
            except DirectoryError:
                self.mirror.ignored += 1  # one bad record must not wedge the mirror
                return
            snap.nodes[info.node_id] = info
            leases[info.node_id] = kv.lease

        def add_block(kv: rpc.KeyValue) -> None:
            op = self._block_op(kv, rpc.Event.PUT, leases)
            if op is not None:
                snap.add_block(op[1], op[2], op[3], op[4])

        rev = await self._list(self._nodes, 0, add_node)
        await self._list(self._blocks, rev, add_block)
        snap.revision = rev
        self._leases = leases
        self._rev = rev
        self.mirror.reset(snap)
        self._synced.set()

    async def _list(self, prefix: bytes, rev: int, fn: Callable[[rpc.KeyValue], None]) -> int:
        """Feed every kv under ``prefix`` at revision ``rev`` (0: now) to ``fn`` in pages;
        returns the revision listed. A compaction between pages raises _Compacted."""
        start, end = prefix, _range_end(prefix)
        while True:
            resp = await self._range(start, end, limit=self._page, revision=rev)
            if rev == 0:
                rev = int(resp.header.revision)
                self._cluster_id = int(resp.header.cluster_id)
            for kv in resp.kvs:
                fn(kv)
            if not resp.more or not resp.kvs:
                return rev
            start = resp.kvs[-1].key + b"\0"

    async def _watch(self) -> None:
        """Follow the prefix from ``_rev + 1`` until the stream ends, fails or stalls."""
        create = rpc.WatchCreateRequest(
            key=self._prefix,
            range_end=_range_end(self._prefix),
            start_revision=self._rev + 1,
            progress_notify=True,
        )
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[rpc.WatchRequest]:
            yield rpc.WatchRequest(create_request=create)
            await stop.wait()

        call = rpc.WatchStub(self._client.channel).Watch(requests())
        tasks = [
            asyncio.create_task(self._read(call), name="kvstore-directory-watch-read"),
            asyncio.create_task(self._guard(), name="kvstore-directory-watch-guard"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            done.pop().result()  # both only ever end by raising
        finally:
            stop.set()
            call.cancel()
            await _end_all(tasks)

    async def _read(self, call: AsyncIterator[rpc.WatchResponse]) -> None:
        with _etcd_errors("watch"):
            async for resp in call:
                if resp.compact_revision:
                    raise _Compacted(f"compacted at {resp.compact_revision}")
                if resp.canceled:
                    raise DirectoryError(f"watch canceled: {resp.cancel_reason}")
                if resp.events:
                    self._apply(resp.events)
                elif not resp.created:
                    self._rev = max(self._rev, int(resp.header.revision))
                    self.mirror.advance(self._rev)
        raise Unavailable("etcd closed the watch stream")

    async def _guard(self) -> None:
        """Raise _Compacted when etcd compacted past ``_rev`` and, one check later, the
        watch has still neither moved nor reported it (a wedged watcher).

        Why not a progress request: etcd 3.4 answers one with the store's revision even
        while the watcher still owes events, which would advance the mirror past them.
        A quiet mirror that a compaction passes re-lists once; nothing is lost.
        """
        suspect = -1
        while True:
            await asyncio.sleep(self._check_s)
            rev = self._rev
            try:
                await self._range(self._probe, revision=rev, count_only=True)
            except _Compacted:
                if rev == suspect:
                    self.stalls += 1
                    raise _Compacted(f"etcd compacted past {rev}; the watch never said") from None
                suspect = rev
            else:
                suspect = -1

    def _apply(self, events: list[rpc.Event]) -> None:
        ops: list[Op] = []
        nodes, nlen = self._nodes, len(self._nodes)
        for ev in events:
            kv = ev.kv
            if kv.key.startswith(self._blocks):
                op = self._block_op(kv, ev.type, self._leases)
                if op is not None:
                    ops.append(op)
            elif kv.key.startswith(nodes):
                node_id = kv.key[nlen:].decode()
                if ev.type == rpc.Event.PUT:
                    try:
                        ops.append((PUT_NODE, NodeInfo.from_json(kv.value, epoch=kv.lease)))
                    except DirectoryError:
                        self.mirror.ignored += 1
                        continue
                    self._leases[node_id] = kv.lease
                else:
                    self._leases.pop(node_id, None)
                    ops.append((DEL_NODE, node_id))
        self._rev = max(self._rev, int(events[-1].kv.mod_revision))
        self.mirror.apply(ops, self._rev)

    def _block_op(self, kv: rpc.KeyValue, etype: int, leases: dict[str, int]) -> Op | None:
        """Decode one block entry; None (and counted) when malformed or of a stale epoch."""
        rest = kv.key[len(self._blocks) :]
        raw_node = rest[_HEX + 1 :]
        node_id = self._names.get(raw_node)
        if node_id is None:
            node_id = self._names.setdefault(raw_node, raw_node.decode())
        try:
            key = binascii.unhexlify(rest[:_HEX])
            if len(key) != 16 or rest[_HEX : _HEX + 1] != b"/" or not raw_node:
                raise ValueError("bad block entry key")
            if etype == rpc.Event.DELETE:
                return (DEL_BLOCK, key, node_id)
            if leases.get(node_id) != kv.lease:
                raise ValueError("entry not under its node's live lease")
            v = kv.value
            return (PUT_BLOCK, key, node_id, _CODE_TIER[v[0]], int(v[1:]))
        except (ValueError, KeyError, IndexError, binascii.Error):
            self.mirror.ignored += 1
            return None
