"""TCP transport: payloads on the data socket, for clients on other hosts.

A read is one GET frame naming the keys; the reply's metadata gives each block's header
and the payloads follow back to back, each received with ``recv_into`` straight into the
caller's tensor (``get_into``) or a fresh value (``get``, on recycled memory: see
buffers.py) and checked against the header's xxh3, computed while the rest of the
payload is still arriving (the receive polls rather than sleeps: see frames.py). A
write is one PUT frame whose payloads are sent from the values' own memory (no staging
copy); the server receives them into reserved slab extents and the node verifies each
against the xxh3 computed here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import BlockHeader, ValueInfo, checksum, checksum_stream, layer_span
from kvstore.client.transport.base import LayerSink, Transport
from kvstore.client.transport.buffers import (
    Landing,
    Outgoing,
    fresh_landing,
    out_landing,
    prepare_writes,
)
from kvstore.client.transport.conn import DataConn
from kvstore.errors import CorruptBlock, KVStoreError, TransportError, Unavailable
from kvstore.observe.counters import NodeCounters
from kvstore.wire.codec import error_of, meta_of
from kvstore.wire.frames import Op
from kvstore.wire.trailers import KEEP_TRAILER, SUM_TRAILER

__all__ = [
    "Inbound",
    "SocketTransport",
    "TcpTransport",
    "miss",
    "plan_inline",
    "put_results",
    "ranged",
    "receive_inline",
    "receive_planned",
]

log = logging.getLogger(__name__)

_PIECE = 512 << 10  # a put's payload is sent and hashed in pieces this large


def miss(get_into: bool) -> Any:
    """The per-key result of a miss."""
    return False if get_into else None


class Inbound:
    """Where one block of a GET reply lands and what its bytes must hash to, with
    ``result`` the miss it becomes if they do not; or, when it has no bytes to receive
    (a miss, an error) or cannot land (a layout mismatch: its bytes are received into
    scratch and dropped), its per-key result."""

    __slots__ = ("digest", "expect", "key", "landing", "result", "view")

    def __init__(self, result: Any, view: Any = None, landing: Landing | None = None) -> None:
        self.result = result
        self.view = view
        self.landing = landing
        self.digest: Any = None
        self.expect = 0
        self.key = b""


def plan_inline(
    conn: DataConn,
    ref: pb.BlockRef,
    out: Any,
    get_into: bool,
    layers: tuple[int, int] | None = None,
) -> Inbound:
    """Where one block's payload (or the layer range asked for) lands, before any of
    the reply's payload bytes are read."""
    if not ref.found:
        return Inbound(error_of(ref.error) or miss(get_into))
    try:
        header = BlockHeader.unpack(ref.header)
        lo, hi = (0, header.payload_len) if layers is None else layer_span(header, layers)
    except CorruptBlock as exc:  # its length is unknown: the stream cannot be resynced
        conn.fs.broken = True
        raise TransportError(f"data socket: corrupt block header in reply: {exc}") from exc
    except KVStoreError as exc:  # the server sent it, so it found the range good
        conn.fs.broken = True
        raise TransportError(f"data socket: a range the server sent is not one: {exc}") from exc
    try:
        if layers is not None:
            landing = out_landing(header, out, hi - lo)
        else:
            landing = out_landing(header, out) if get_into else fresh_landing(header)
    except KVStoreError as exc:
        return Inbound(exc, memoryview(bytearray(hi - lo)))
    plan = Inbound(miss(get_into), landing.view, landing)
    plan.digest = checksum_stream()  # hashed while the rest arrives
    plan.expect = header.checksum if layers is None else ref.range_checksum
    plan.key = header.key
    return plan


def receive_planned(conn: DataConn, plans: Sequence[Inbound], counters: NodeCounters) -> list[Any]:
    """Receive the planned payloads, all at once (DataConn.recv_many), and return the
    per-key results: a payload that fails its checksum is a miss."""
    views = [memoryview(p.view) for p in plans if p.view is not None]
    digests = [p.digest for p in plans if p.view is not None]
    if len(views) == 1:  # the server is sending them now
        conn.recv_into(views[0], spin=True, digest=digests[0])
    elif views:
        conn.recv_many(views, digests)
    results = []
    for p in plans:
        if p.landing is None:
            results.append(p.result)
        elif p.digest.intdigest() != p.expect:
            counters.inc("corrupt_transfers")
            log.warning(
                "block %s failed its checksum after transfer; served as a miss", p.key.hex()
            )
            results.append(p.result)
        else:
            results.append(p.landing.finish())
    return results


def receive_inline(
    conn: DataConn,
    ref: pb.BlockRef,
    out: Any,
    get_into: bool,
    counters: NodeCounters,
    layers: tuple[int, int] | None = None,
) -> Any:
    """Receive one block's payload (or the layer range asked for) from the socket;
    returns its per-key result."""
    return receive_planned(conn, [plan_inline(conn, ref, out, get_into, layers)], counters)[0]


def ranged(req: pb.GetRequest, layers: tuple[int, int] | None) -> pb.GetRequest:
    """``req`` asking for layers [a, b) of each block (whole blocks for None)."""
    if layers is not None:
        req.layer_from, req.layer_to = layers
    return req


def put_results(resp: pb.PutResponse, sent: Sequence[Any], results: list[Any]) -> list[Any]:
    """Merge a PutResponse into per-key results (``sent`` in request order)."""
    if len(resp.results) != len(sent):
        raise TransportError(f"{len(resp.results)} results for {len(sent)} values")
    for item, r in zip(sent, resp.results, strict=True):
        results[item.index] = error_of(r.error) or r.stored
    return results


class SocketTransport(Transport[DataConn]):
    """What both socket transports share: the metadata questions, one frame each."""

    def exists(self, conn: DataConn, keys: Sequence[bytes], deadline: float) -> list[bool]:
        req = pb.KeysRequest(keys=keys)
        return list(conn.call(Op.EXISTS, req, pb.ExistsResponse, deadline)[0].present)

    def match_prefix(self, conn: DataConn, keys: Sequence[bytes], deadline: float) -> int:
        req = pb.KeysRequest(keys=keys)
        return int(conn.call(Op.MATCH, req, pb.MatchPrefixResponse, deadline)[0].matched)


class TcpTransport(SocketTransport):
    """Payloads on the socket."""

    name = "tcp"

    def read(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        req = ranged(pb.GetRequest(scope=scope, keys=keys), layers)
        resp, _ = conn.call(Op.GET, req, pb.GetResponse, deadline)
        if len(resp.blocks) != len(keys):
            conn.fs.broken = True
            raise TransportError(f"{len(resp.blocks)} blocks for {len(keys)} keys")
        get_into = outs is not None
        plans = [
            plan_inline(conn, ref, outs[i] if outs is not None else None, get_into, layers)
            for i, ref in enumerate(resp.blocks)
        ]
        return receive_planned(conn, plans, self.counters)

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
        # each checksum follows its payload, hashed while the payload travels; over UCX
        # a single item gains nothing from it (its blocking-mode worker does not move
        # the payload while this thread hashes), so it is hashed first there
        if conn.info.put_sums_follow and (len(keys) > 1 or not conn.on_ucx):
            items = prepare_writes(keys, values, results, limit, hashed=False)
            if items:
                self._send_hashing(conn, items, scope, deadline)
                resp = conn.read_reply(Op.PUT, pb.PutResponse, deadline)
                put_results(resp, items, results)
            return results
        items = prepare_writes(keys, values, results, limit)
        if not items:
            return results
        req = pb.PutRequest(scope=scope)
        for it in items:
            req.items.add(key=it.key, meta=meta_of(it.info), checksum=it.sum)
        body = [it.data for it in items]
        total = sum(it.info.nbytes for it in items)
        resp, _ = conn.call(Op.PUT, req, pb.PutResponse, deadline, body, total)
        return put_results(resp, items, results)

    def begin_layers(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        infos: Sequence[ValueInfo],
        layers: int,
        scope: pb.Scope,
        deadline: float,
    ) -> LayerSink:
        if not conn.info.put_layers:
            raise Unavailable("the server does not take layer-by-layer puts (upgrade it)")
        req = pb.PutRequest(scope=scope, layers=layers)
        for key, info in zip(keys, infos, strict=True):
            req.items.add(key=key, meta=meta_of(info))
        total = sum(info.nbytes + KEEP_TRAILER.size for info in infos)
        conn.send_only(Op.PUT, req, deadline, [], total)
        return _StreamedPut(conn, len(keys))

    @staticmethod
    def _send_hashing(
        conn: DataConn, items: list[Outgoing], scope: pb.Scope, deadline: float
    ) -> None:
        """PUT with each payload's xxh3 sent after it (PutRequest.sums_follow), so that
        no hash delays the first byte and the server checks each item against its own
        hash as it lands.

        On a socket each payload goes in pieces of ``_PIECE`` bytes, each hashed (from
        cache) right after it is handed to the kernel, while the server receives it.
        A single put used to hash its payload first, and a batch hashed each whole
        payload after sending it. Pieces beat both (benchmarks/RESULTS.md, "pieces
        hashed while they travel")."""
        req = pb.PutRequest(scope=scope, sums_follow=True)
        for it in items:
            req.items.add(key=it.key, meta=meta_of(it.info))
        total = sum(it.info.nbytes + SUM_TRAILER.size for it in items)
        if not conn.on_ucx:
            conn.send_only(Op.PUT, req, deadline, [], total)
            for it in items:
                data = it.data  # flat uint8 (host_bytes)
                digest = checksum_stream()
                for at in range(0, data.nbytes, _PIECE):
                    piece = data[at : at + _PIECE]
                    conn.send_more([piece])
                    digest.update(piece)
                it.sum = digest.intdigest()
                conn.send_more([SUM_TRAILER.pack(it.sum)])
            return
        # over UCX a payload's send is not waited for (its receiver pulls it while this
        # thread hashes the next); read_reply waits for all of them
        conn.send_only(Op.PUT, req, deadline, [items[0].data], total, wait=False)
        for i, it in enumerate(items):
            it.sum = checksum(it.data)  # the payload is on its way; hashed from cache
            after: list[Any] = [SUM_TRAILER.pack(it.sum)]
            if i + 1 < len(items):
                after.append(items[i + 1].data)
            conn.send_more(after, wait=False)


class _StreamedPut(LayerSink):
    """A layer-by-layer PUT on the data socket: the frame's header went first, each
    layer range follows as the caller produces it, the trailer and one reply end it."""

    def __init__(self, conn: DataConn, n: int) -> None:
        self.conn, self.n = conn, n

    def send(self, parts: Sequence[Any], deadline: float) -> None:
        self.conn.fs.set_deadline(deadline)
        self.conn.send_more(parts)

    def finish(self, sums: Sequence[int], keep: Sequence[bool], deadline: float) -> list[Any]:
        tail = b"".join(KEEP_TRAILER.pack(s, k) for s, k in zip(sums, keep, strict=True))
        self.conn.fs.set_deadline(deadline)
        self.conn.send_more([tail])
        resp = self.conn.read_reply(Op.PUT, pb.PutResponse, deadline)
        if len(resp.results) != self.n:
            self.conn.fs.broken = True
            raise TransportError(f"{len(resp.results)} results for {self.n} values")
        return [
            None if not k else error_of(r.error) or r.stored
            for r, k in zip(resp.results, keep, strict=True)
        ]

    def abort(self, deadline: float) -> None:
        """The frame cannot be cut short in step: the connection goes, and the server,
        its stream ended early, releases every reservation."""
        self.conn.fs.broken = True
