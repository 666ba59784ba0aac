"""The data socket's write frames: PUT (payloads in the body), and for a same-host
client RESERVE, COMMIT and ABORT (payloads copied into the shared segment).

These handlers speak frames only: they check that a body adds up, decode the items,
hand the gateway a :class:`~kvstore.server.receiver.FrameReceiver` for the payloads and
encode what it answers. Admission, leases and credits are the gateway's
(kvstore/server/gateway.py tells the write story). A PUT refused whole before any of
its body was read has its body skipped, so the stream stays in step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo
from kvstore.errors import KVStoreError
from kvstore.server.frame_codec import Connection, parse, put_result
from kvstore.server.receiver import FrameReceiver
from kvstore.server.shm_writes import CommitItem, CreditBind
from kvstore.server.write_batch import WriteItem
from kvstore.wire.codec import info_from_meta, status_of
from kvstore.wire.frames import ProtocolError
from kvstore.wire.trailers import KEEP_TRAILER, SUM_TRAILER
from kvstore.wire.ucx import UcxFrames

__all__ = ["WriteFrames"]

log = logging.getLogger(__name__)

_CLIENT_COPY_RATE = 8e9  # bytes/s a same-host client copies into the segment, at least


class WriteFrames:
    """One connection's write handlers (``handler(meta, body_len)``)."""

    def __init__(self, session: Connection) -> None:
        self.s = session

    def put(self, meta: bytes, body_len: int) -> pb.PutResponse:
        s = self.s
        cap = s.gw.config.max_batch * s.gw.max_value_bytes
        if body_len > cap:  # refused at once: skipping it would take forever
            raise ProtocolError(
                f"PUT body of {body_len} bytes exceeds max_batch x max_value_bytes ({cap})"
            )
        req = parse(pb.PutRequest, meta)
        items = _write_items(req)
        if req.layers:
            return self._put_layers(req, items, body_len)
        trailer = SUM_TRAILER.size if req.sums_follow else 0  # each payload's xxh3 after it
        expected = sum(it.nbytes + trailer for it in items)
        if expected != body_len:
            raise ProtocolError(f"PUT items add up to {expected} bytes, frame has {body_len}")
        rx = FrameReceiver(s.fs, s.id, trailer, at_once=isinstance(s.fs, UcxFrames))
        scope = req.scope
        try:
            results = s.gw.write(s.principal, scope.model, scope.layout, items, rx, path=s.path)
        except KVStoreError:
            if not rx.received and not s.fs.broken:
                s.fs.discard(body_len)  # refused whole: the stream stays in step
            raise
        resp = pb.PutResponse()
        for r in results:
            put_result(r, resp.results.add())
        return resp

    def _put_layers(
        self, req: pb.PutRequest, items: list[WriteItem], body_len: int
    ) -> pb.PutResponse:
        """A layer-by-layer PUT (PutRequest.layers): layer 0 of every item, layer 1 of
        every item, ..., then each item's (xxh3, keep) trailer."""
        s, layers = self.s, req.layers
        sizes = [it.nbytes for it in items]
        if any(n % layers for n in sizes):
            raise ProtocolError(f"PUT of {layers} layers: an item does not split into them")
        if sum(sizes) + KEEP_TRAILER.size * len(items) != body_len:
            raise ProtocolError(
                f"PUT items add up to {sum(sizes)} bytes and trailers, frame has {body_len}"
            )
        rx = FrameReceiver(s.fs, s.id)
        scope = req.scope
        try:
            results = s.gw.write_layers(
                s.principal, scope.model, scope.layout, items, layers, rx, path=s.path
            )
        except KVStoreError:
            if not rx.received and not s.fs.broken:
                s.fs.discard(body_len)  # refused whole: the stream stays in step
            raise
        resp = pb.PutResponse()
        for r in results:
            out = resp.results.add()
            if r is not None:
                put_result(r, out)
        return resp

    def reserve(self, meta: bytes, body_len: int) -> pb.PutResponse:
        s = self.s
        req = parse(pb.PutRequest, meta)
        scope = req.scope
        items = _write_items(req)
        leases = s.gw.reserve_leased(s.principal, scope.model, scope.layout, items, s.id)
        # the client copies the granted bytes before its first COMMIT: poll that much
        # longer for it (a sleeping thread costs a wake-up per put)
        granted = sum(it.nbytes for it, lease in zip(items, leases, strict=True) if lease)
        s.copying_s = granted / _CLIENT_COPY_RATE
        resp = pb.PutResponse(shm_name=s.gw.shm_name)
        for lease in leases:
            out = resp.results.add()
            if isinstance(lease, KVStoreError):
                out.error.CopyFrom(status_of(lease))
            elif lease is not None:
                out.lease_id, out.offset = lease.id, lease.obj.shm_offset
                resp.lease_expires_ns = resp.lease_expires_ns or lease.expires_ns
        self._lend_credits(scope, req.credits, resp)
        return resp

    def commit(self, meta: bytes, body_len: int) -> pb.PutResponse:
        s = self.s
        req = parse(pb.CommitRequest, meta)
        items: list[CommitItem | CreditBind] = []
        for it in req.items:
            if it.key:
                info: ValueInfo | KVStoreError
                try:
                    info = info_from_meta(it.meta)
                except KVStoreError as exc:
                    info = exc
                items.append(CreditBind(it.lease_id, it.checksum, it.key, info))
            else:
                items.append(CommitItem(it.lease_id, it.checksum))
        scope = req.scope
        resp = pb.PutResponse()
        results = s.gw.commit_leased(s.principal, items, scope.model, scope.layout, s.id)
        for r in results:
            put_result(r, resp.results.add())
        self._lend_credits(scope, req.credits, resp)
        return resp

    def _lend_credits(self, scope: pb.Scope, sizes: Sequence[int], resp: pb.PutResponse) -> None:
        """The write credits asked for (PutRequest.credits) that the gateway lends this
        connection, into ``resp``. Never an error: the request's own results stand,
        and a writer without credits reserves as before."""
        if not sizes:
            return
        s = self.s
        try:
            granted = s.gw.lend_credits(s.principal, scope.model, scope.layout, sizes, s.id)
        except KVStoreError as exc:  # a scope this tenant cannot write, a closed node
            log.debug("data connection %d: no write credits: %s", s.id, exc)
            return
        # the client copies into them before its next request: poll that much longer
        lent = sum(lease.obj.info.nbytes for lease in granted)
        s.copying_s = max(s.copying_s, lent / _CLIENT_COPY_RATE)
        for lease in granted:
            resp.credits.add(lease_id=lease.id, offset=lease.obj.shm_offset)
            resp.credits_expire_ns = resp.credits_expire_ns or lease.expires_ns

    def abort(self, meta: bytes, body_len: int) -> pb.LeaseResponse:
        req = parse(pb.LeaseRequest, meta)
        done, expired = self.s.gw.abort_leased(self.s.principal, req.lease_ids)
        return pb.LeaseResponse(released=done, expired=expired)


def _write_items(req: pb.PutRequest) -> list[WriteItem]:
    """A PUT or RESERVE request's items; one whose metadata does not decode carries
    its error (that item fails, the others go on)."""
    items = []
    for it in req.items:
        info: ValueInfo | KVStoreError
        try:
            info = info_from_meta(it.meta)
        except KVStoreError as exc:
            info = exc
        items.append(WriteItem(it.key, info, it.checksum, int(it.meta.nbytes)))
    return items
