"""TCP transport: payloads on the data socket, for clients on other hosts.

A read is one GET frame naming the keys; the reply's metadata gives each block's header
and the payloads follow back to back, each received with ``recv_into`` straight into the
caller's tensor (``get_into``) or a fresh value (``get``, on recycled memory: see
buffers.py) and checked against the header's xxh3, computed while the rest of the
payload is still arriving (the receive polls rather than sleeps: see frames.py). A
write is one PUT frame whose payloads are sent from the values' own memory (no staging
copy); the server receives them into reserved slab extents and the node verifies each
against the xxh3 computed here. Device tensors (device_paths.py) are the exception both
ways: a read lands each payload in pinned staging and copies it to the device only if
its xxh3 matches; a put copies each payload device-to-host into a ring of pinned
staging buffers, sending item i while the next ones copy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo, checksum, checksum_stream
from kvstore.client.device.reads import DeviceRead
from kvstore.client.device.side import DeviceSide
from kvstore.client.transport.base import LayerSink, Transport
from kvstore.client.transport.buffers import Outgoing, prepare_writes
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.device_paths import (
    lander,
    receive_device,
    stage_values,
    staged_puts,
)
from kvstore.client.transport.inbound import (
    Inbound,
    miss,
    plan_inline,
    receive_inline,
    receive_planned,
)
from kvstore.errors import TransportError, Unavailable
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
    """What both socket transports share: the metadata questions, one frame each, and
    the device side that moves a call's device tensors (device_paths.py)."""

    def __init__(self, counters: NodeCounters, device: DeviceSide | None = None) -> None:
        super().__init__(counters)
        self.device = device if device is not None else DeviceSide()

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
        if outs is not None and self.device.takes(outs):  # pinned staging, then H2D
            land = lander(self.device)
            plans = [
                plan_inline(conn, ref, outs[i], True, layers, land)
                for i, ref in enumerate(resp.blocks)
            ]
            with DeviceRead(self.device.engine) as landing:
                return receive_device(conn, plans, self.counters, landing)
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
        dev = self.device.engine.claims if self.device.takes(values) else None
        # each checksum follows its payload, hashed while the payload travels; over UCX
        # a single item gains nothing from it (its blocking-mode worker does not move
        # the payload while this thread hashes), so it is hashed first there
        if conn.info.put_sums_follow and (len(keys) > 1 or not conn.on_ucx):
            items = prepare_writes(keys, values, results, limit, hashed=False, on_device=dev)
            if dev is not None and conn.on_ucx:  # its sends are not waited for: all staged
                stage_values(self.device, items, hashed=False)
            if items:
                self._send_hashing(conn, items, scope, deadline)
                resp = conn.read_reply(Op.PUT, pb.PutResponse, deadline)
                put_results(resp, items, results)
            return results
        items = prepare_writes(keys, values, results, limit, on_device=dev)
        stage_values(self.device, items, hashed=True)
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

    def _send_hashing(
        self, conn: DataConn, items: list[Outgoing], scope: pb.Scope, deadline: float
    ) -> None:
        """PUT with each payload's xxh3 sent after it (PutRequest.sums_follow), so that
        no hash delays the first byte and the server checks each item against its own
        hash as it lands.

        On a socket each payload goes in pieces of ``_PIECE`` bytes, each hashed (from
        cache) right after it is handed to the kernel, while the server receives it.
        A single put used to hash its payload first, and a batch hashed each whole
        payload after sending it. Pieces beat both (benchmarks/RESULTS.md, "pieces
        hashed while they travel").

        Device values (on a socket) go through a ring of pinned staging buffers: item
        i is hashed and sent while the copies of the next ones run (_send_staged)."""
        req = pb.PutRequest(scope=scope, sums_follow=True)
        for it in items:
            req.items.add(key=it.key, meta=meta_of(it.info))
        total = sum(it.info.nbytes + SUM_TRAILER.size for it in items)
        if not conn.on_ucx:
            conn.send_only(Op.PUT, req, deadline, [], total)
            if items[0].device is not None:
                _send_staged(conn, self.device, items)
                return
            for it in items:
                it.sum = _send_pieces(conn, it.data)  # flat uint8 (host_bytes)
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


def _send_pieces(conn: DataConn, data: Any) -> int:
    """Send flat bytes ``data`` in pieces of ``_PIECE`` bytes, each hashed (from cache)
    right after it is handed to the kernel, while the server receives it; its xxh3."""
    digest = checksum_stream()
    for at in range(0, data.nbytes, _PIECE):
        piece = data[at : at + _PIECE]
        conn.send_more([piece])
        digest.update(piece)
    return int(digest.intdigest())


def _send_staged(conn: DataConn, side: DeviceSide, items: list[Outgoing]) -> None:
    """The payloads (and trailing sums) of device items, each out of the pinned staging
    ring as its copy completes (device_paths.staged_puts): item i is hashed and sent
    while the copies of items i + 1 .. i + ring - 1 run, and its buffer takes another
    copy only once its send has returned. A failure after the frame's header went (a
    device error mid-batch) leaves the frame cut short: the connection goes, and the
    server, its stream ended early, releases every reservation."""
    staged = staged_puts(side, items)
    try:
        for it, data in staged:
            it.sum = _send_pieces(conn, data)
            conn.send_more([SUM_TRAILER.pack(it.sum)])
    except BaseException:
        conn.fs.broken = True
        raise
    finally:
        staged.close()  # waits for the copies still queued into the ring


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
