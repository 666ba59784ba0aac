"""Where a reply's inline payloads land: planned from each block's header before any
payload byte is read, then received in order and checked against their xxh3 (a
mismatch is a miss, never bytes). Shared by the TCP transport and the shared-memory
transport's inline blocks (those not in DRAM); a plan's landing may be a device target
(kvstore/client/transport/device_paths.py receives those through pinned staging).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import BlockHeader, checksum_stream, layer_span
from kvstore.client.transport.buffers import fresh_landing, out_landing
from kvstore.client.transport.conn import DataConn
from kvstore.errors import CorruptBlock, KVStoreError, TransportError
from kvstore.observe.counters import NodeCounters
from kvstore.wire.codec import error_of

__all__ = ["Inbound", "Lander", "miss", "plan_inline", "receive_inline", "receive_planned"]

log = logging.getLogger(__name__)

Lander = Callable[[BlockHeader, Any, int], Any]
"""(header, out, bytes) -> where a get_into's payload lands (a Landing or a device
target with ``view`` None), after the dtype and size checks."""


def miss(get_into: bool) -> Any:
    """The per-key result of a miss."""
    return False if get_into else None


class Inbound:
    """Where one block of a GET reply lands and what its bytes must hash to, with
    ``result`` the miss it becomes if they do not; or, when it has no bytes to receive
    (a miss, an error) or cannot land (a layout mismatch: its bytes are received into
    scratch and dropped), its per-key result."""

    __slots__ = ("digest", "expect", "key", "landing", "result", "view")

    def __init__(self, result: Any, view: Any = None, landing: Any = None) -> None:
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
    land: Lander | None = None,
) -> Inbound:
    """Where one block's payload (or the layer range asked for) lands, before any of
    the reply's payload bytes are read (``land``: where a get_into lands instead of
    the caller's host buffer)."""
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
        if land is not None and get_into:
            landing = land(header, out, hi - lo)
        elif layers is not None:
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
