"""A write's payloads off a data connection (kvstore/server/write_batch.py's receiver).

The session that decodes a PUT builds one :class:`FrameReceiver` for it and hands it to
the gateway, which asks it for each item's payload once that item's reservation is
there. Each payload arrives in a single ``recv_into`` straight into its reserved
extent, hashed piece by piece while the next piece arrives, which spares the commit a
second pass over the bytes. ``received`` says whether any of the body was read: a
request refused whole before that skips its body, so the stream stays in step.

A stalled payload is cut by the lease reaper (:meth:`FrameReceiver.cut` shuts the
socket down, which wakes the receive); the connection is then lost both ways.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import Any

from kvstore.blocks import checksum_stream
from kvstore.errors import KVStoreError
from kvstore.server.write_batch import Filled, LayerReceiver
from kvstore.wire.frames import FrameSocket
from kvstore.wire.trailers import KEEP_TRAILER, SUM_TRAILER
from kvstore.wire.ucx import UcxFrames

__all__ = ["FrameReceiver"]

log = logging.getLogger(__name__)


class FrameReceiver(LayerReceiver):
    """One PUT body's payloads, in order, off ``fs``: each followed by its xxh3 when
    ``trailer`` (PutRequest.sums_follow), a layer-by-layer body closed by one
    (xxh3, keep) per item; ``at_once`` for a connection on UCX, which gains from
    posting a whole batch's receives together."""

    def __init__(
        self, fs: FrameSocket | UcxFrames, owner: int, trailer: int = 0, at_once: bool = False
    ) -> None:
        self.fs = fs
        self.owner = owner
        self.trailer = trailer
        self.at_once = at_once
        self.received = 0  # body bytes read or skipped so far

    def receive(self, target: Any, nbytes: int) -> Filled:
        fs, trailer = self.fs, self.trailer
        self.received += nbytes + trailer
        digest = checksum_stream()
        fs.recv_into(target.data, spin=True, digest=digest)
        if trailer:
            return Filled(SUM_TRAILER.unpack(fs.recv_bytes(trailer))[0], int(digest.intdigest()))
        return Filled(None, int(digest.intdigest()))

    def skip(self, nbytes: int) -> None:
        self.received += nbytes + self.trailer
        self.fs.discard(nbytes + self.trailer)

    def receive_all(self, targets: list[Any], sizes: Sequence[int]) -> list[Filled]:
        """Every payload posted at once (UcxFrames.recv_many), each straight into its
        reservation's extent (a dropped item's into scratch), each trailer after it."""
        trailer = self.trailer
        views: list[memoryview] = []
        digests: list[Any] = []  # one per view: a payload's, or None (a trailer, scratch)
        items: list[tuple[Any, bytearray | None]] = []  # per item: its digest, its trailer
        for target, n in zip(targets, sizes, strict=True):
            digest = None if target is None else checksum_stream()
            views.append(memoryview(bytearray(n) if target is None else target.data))
            digests.append(digest)
            tail = bytearray(trailer) if trailer else None
            if tail is not None:
                views.append(memoryview(tail))
                digests.append(None)
            items.append((digest, tail))
        self.received += sum(sizes) + trailer * len(sizes)
        self.fs.recv_many(views, digests)
        return [
            Filled(
                None if tail is None else SUM_TRAILER.unpack(tail)[0],
                None if digest is None else int(digest.intdigest()),
            )
            for digest, tail in items
        ]

    def closing_sums(self, count: int) -> list[tuple[int, bool]]:
        size = KEEP_TRAILER.size * count
        self.received += size
        tail = self.fs.recv_bytes(size)
        return [(c, bool(k)) for c, k in KEEP_TRAILER.iter_unpack(tail)]

    def cut(self) -> None:
        """Shut the plain socket down (also under TLS: the TLS object stays the
        connection thread's), which wakes the connection's thread from its receive."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.fs.sock, socket.SHUT_RDWR)

    def stalled(self, nbytes: int, ttl_s: float) -> KVStoreError:
        self.fs.broken = True  # the socket is shut: nothing more goes either way
        log.info(
            "data connection %d: a put of %d bytes stalled past %.1f s", self.owner, nbytes, ttl_s
        )
        return super().stalled(nbytes, ttl_s)
