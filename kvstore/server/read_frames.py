"""The data socket's read frames: GET, LEASE, RELEASE, TOUCH, EXISTS and MATCH.

A GET's hits go inline after its reply. A LEASE (a same-host client) gets, for each hit
in the shared segment, a read lease and the extent's offset instead of the bytes; other
hits go inline. RELEASE and TOUCH have no reply, not even an error (an ERROR frame there
would answer the client's next request): what fails is logged and dropped.
"""

from __future__ import annotations

import logging
import time

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import checksum, layer_span
from kvstore.errors import CorruptBlock, InvalidValue, KVStoreError
from kvstore.node.store import BlockRead
from kvstore.server.frame_codec import Connection, parse
from kvstore.server.read_batch import ReadItem
from kvstore.wire.codec import status_of
from kvstore.wire.frames import REPLY, Op

__all__ = ["ReadFrames"]

log = logging.getLogger(__name__)


class ReadFrames:
    """One connection's read and metadata handlers (``handler(meta, body_len)``)."""

    def __init__(self, session: Connection) -> None:
        self.s = session

    def get(self, meta: bytes, body_len: int) -> None:
        s = self.s
        req = parse(pb.GetRequest, meta)
        layers = _layers(req)
        scope = req.scope
        with s.gw.read(s.principal, scope.model, scope.layout, req.keys, path=s.path) as batch:
            resp = pb.GetResponse()
            parts = [_describe(r, resp.blocks.add(), layers) for r in batch.items]
            body = [mv for mv in parts if mv is not None]
            s.fs.send(Op.GET | REPLY, resp.SerializeToString(), body, _total(body))

    def lease(self, meta: bytes, body_len: int) -> None:
        s, gw = self.s, self.s.gw
        req = parse(pb.GetRequest, meta)
        scope, layers = req.scope, _layers(req)
        with gw.lease(s.principal, scope.model, scope.layout, req.keys, s.id) as batch:
            resp = pb.GetResponse(shm_name=gw.shm_name)
            resp.server_now_ns = time.monotonic_ns()
            resp.namespace_fp = batch.namespace_fp
            body = []
            for i, r in enumerate(batch.items):
                ref = resp.blocks.add()
                lease = batch.leases.get(i)
                if lease is not None and isinstance(r, BlockRead) and layers is not None:
                    try:
                        layer_span(r.header, layers)  # the client copies it: check it here
                    except KVStoreError as exc:
                        gw.release_reads(s.principal, [lease.id])
                        ref.error.CopyFrom(status_of(exc))
                        continue
                if lease is not None and isinstance(r, BlockRead):
                    ref.found, ref.header = True, r.header.pack()
                    ref.lease_id, ref.offset = lease.id, r.shm_offset
                    resp.lease_expires_ns = resp.lease_expires_ns or lease.expires_ns
                    continue
                mv = _describe(r, ref, layers)
                if mv is not None:
                    body.append(mv)
            s.fs.send(Op.LEASE | REPLY, resp.SerializeToString(), body, _total(body))

    def release(self, meta: bytes, body_len: int) -> None:
        req = parse(pb.LeaseRequest, meta)
        try:  # no reply, not even an error (see touch)
            self.s.gw.release_reads(self.s.principal, req.lease_ids)
        except KVStoreError as exc:
            log.warning("data connection %d: RELEASE failed: %s", self.s.id, exc)

    def touch(self, meta: bytes, body_len: int) -> None:
        # No reply, not even an error: an ERROR frame here would answer the client's
        # next request. What cannot be counted is logged and dropped.
        req = parse(pb.TouchRequest, meta)
        try:
            self.s.gw.touch(self.s.principal, req.keys, req.payload_bytes, req.call_seconds)
        except KVStoreError as exc:
            log.warning(
                "data connection %d: TOUCH of %d keys dropped: %s", self.s.id, len(req.keys), exc
            )

    def exists(self, meta: bytes, body_len: int) -> pb.ExistsResponse:
        req = parse(pb.KeysRequest, meta)
        return pb.ExistsResponse(present=self.s.gw.exists(self.s.principal, req.keys))

    def match(self, meta: bytes, body_len: int) -> pb.MatchPrefixResponse:
        req = parse(pb.KeysRequest, meta)
        return pb.MatchPrefixResponse(matched=self.s.gw.match_prefix(self.s.principal, req.keys))


def _describe(
    r: ReadItem, ref: pb.BlockRef, layers: tuple[int, int] | None = None
) -> memoryview | None:
    """Fill a BlockRef for a payload sent inline; returns the payload to send (for
    ``layers``, their bytes alone, with their checksum in the ref)."""
    ref.offset = -1
    if isinstance(r, KVStoreError):
        ref.error.CopyFrom(status_of(r))
        return None
    if r is None:
        return None
    try:
        span = None if layers is None else layer_span(r.header, layers)
        # host() first: bytes leaving a device are checked, and the header then
        # carries the checksum they were checked against (BlockRead)
        whole = memoryview(r.host())
    except CorruptBlock:  # the node counted and dropped it: a miss
        return None
    except KVStoreError as exc:
        ref.error.CopyFrom(status_of(exc))
        return None
    if span is None:
        ref.found, ref.header = True, r.header.pack()
        return whole
    part = whole[span[0] : span[1]]
    ref.found, ref.header, ref.range_checksum = True, r.header.pack(), checksum(part)
    return part


def _layers(req: pb.GetRequest) -> tuple[int, int] | None:
    """The layer range a GET or LEASE asks for (None: whole blocks)."""
    if not req.layer_to:
        return None
    if req.layer_from >= req.layer_to:
        raise InvalidValue(f"layers [{req.layer_from}, {req.layer_to}): an empty range")
    return req.layer_from, req.layer_to


def _total(body: list[memoryview]) -> int:
    return sum(mv.nbytes for mv in body)
