"""Same-host reads without a round trip: find a DRAM block in the server's published index
and copy it out of the segment, checked by the index's sequence lock.

The contract is in kvstore/shm/index.py. Here is the client's half: the key is
scoped to the client's tenant exactly as the server would (kvstore/tenants.py: the tenant
and its scope key come from the server's INFO reply, so scoping is the same function of
the same inputs),
the block header found at the published offset must name that scoped key and the
namespace the server resolved for the request's scope (learned from a LEASE reply, see
:meth:`DirectReader.learn`), and the slot must be unchanged after the copy. A key that is
not published, a slot being rewritten, a header that does not match or a server that is
no longer alive is a fallback to the leased path (``FALLBACK``), never a miss and never
wrong bytes.

The server hears of these reads afterwards: each connection batches the keys it served
and sends them as a TOUCH frame (DataConn.defer_touch), so hit counts, bytes out and the
eviction order include them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader, checksum, layer_span
from kvstore.client.device.reads import DeviceRead
from kvstore.client.transport.buffers import check_out, fresh_landing, out_landing
from kvstore.errors import CorruptBlock, KVStoreError
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexReader
from kvstore.tenants import Principal

__all__ = ["FALLBACK", "DirectReader"]


class _Fallback:
    """Marker: read this key through the leased path."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FALLBACK"


FALLBACK: Any = _Fallback()


class DirectReader:
    """Reads blocks of one server instance through its published index.

    Shared by the connections of one client to that instance; every method is safe to
    call from several threads (the index and segment are only read; ``fps`` is a dict
    whose items are replaced whole).
    """

    def __init__(
        self, index: IndexReader, view: np.ndarray, tenant: str, scope_key: bytes = b""
    ) -> None:
        self.index = index
        self.view = view  # the DRAM segment, uint8
        self.size = int(view.size)
        self._scope = Principal(tenant, scope_key=scope_key).scope_all
        self.fps: dict[tuple[str, str], bytes] = {}  # (model, layout) -> namespace fp

    def learn(self, model: str, layout: str, fp: bytes) -> None:
        """Remember the namespace the server resolved for a scope (b"": none)."""
        self.fps[(model, layout)] = fp

    def namespace(self, model: str, layout: str) -> bytes | None:
        """The namespace fingerprint to expect for a scope; None until learned."""
        return self.fps.get((model, layout))

    def alive(self) -> bool:
        """Whether the index still belongs to a live server."""
        return self.index.alive()

    def scoped(self, keys: list[bytes]) -> list[bytes]:
        """The node-side keys of this tenant's keys."""
        return self._scope(keys)

    def locate(self, skey: bytes, nsfp: bytes) -> tuple[int, int, BlockHeader, int] | None:
        """``(slot, seq, header, payload start)`` of a published block whose header names
        ``skey`` and the namespace, or None (a fallback): still to be confirmed by
        :meth:`IndexReader.unchanged` after its bytes are copied."""
        idx = self.index
        found = idx.find(skey)
        if found is None:
            return None
        slot, seq = found
        off = idx.offset(slot)
        start = off + HEADER_SIZE
        if off < 0 or start > self.size:
            return None
        try:
            header = BlockHeader.unpack(self.view[off:start])
        except CorruptBlock:
            return None  # being rewritten under us: the slot check would fail too
        n = header.payload_len
        if header.key != skey or (nsfp and header.namespace_fp != nsfp) or start + n > self.size:
            return None
        return slot, seq, header, start

    def read(
        self,
        skey: bytes,
        out: Any,
        get_into: bool,
        nsfp: bytes,
        verify: bool,
        counters: NodeCounters,
        layers: tuple[int, int] | None = None,
    ) -> tuple[Any, int]:
        """One block (or layers [a, b) of it) by its scoped key: (the per-key result,
        payload bytes copied), or (FALLBACK, 0)."""
        idx = self.index
        loc = self.locate(skey, nsfp)
        if loc is None:
            return FALLBACK, 0
        slot, seq, header, start = loc
        n = header.payload_len
        lo, hi = 0, n
        try:
            if layers is not None:
                lo, hi = layer_span(header, layers)
                landing = out_landing(header, out, hi - lo)
            else:
                landing = out_landing(header, out) if get_into else fresh_landing(header)
        except KVStoreError as exc:
            return (exc, 0) if idx.unchanged(slot, seq) else (FALLBACK, 0)
        whole = self.view[start : start + n]
        np.copyto(landing.view, whole[lo:hi])
        # a range is checked as the block it came from (before the slot check: the
        # block must not change between the two)
        bad = verify and checksum(landing.view if layers is None else whole) != header.checksum
        if not idx.unchanged(slot, seq):
            counters.inc("shm_direct_raced")
            return FALLBACK, 0
        if bad:
            counters.inc("corrupt_transfers")
            return FALLBACK, 0
        return landing.finish(), hi - lo

    def read_device(
        self,
        skeys: Sequence[bytes],
        outs: Sequence[Any],
        nsfp: bytes,
        verify: bool,
        counters: NodeCounters,
        landing: DeviceRead,
        layers: tuple[int, int] | None = None,
    ) -> list[tuple[Any, int]]:
        """Blocks into device tensors: every published block's copy is queued into one
        submission, the batch is waited for once, and only then is each slot checked
        (an async copy is over only at its event); a slot that changed meanwhile is a
        fallback, never wrong bytes. No host copy and no host hash (unless ``verify``:
        then the block's bytes in the segment, before the slot check)."""
        idx = self.index
        flat = landing.engine.flat
        out: list[tuple[Any, int]] = [(FALLBACK, 0)] * len(skeys)
        queued = []
        for i, skey in enumerate(skeys):
            loc = self.locate(skey, nsfp)
            if loc is None:
                continue
            slot, seq, header, start = loc
            try:
                lo, hi = (0, header.payload_len) if layers is None else layer_span(header, layers)
                check_out(header, outs[i], hi - lo)
            except KVStoreError as exc:
                out[i] = (exc, 0) if idx.unchanged(slot, seq) else (FALLBACK, 0)
                continue
            landing.from_segment(flat(outs[i]), start + lo, hi - lo)
            queued.append((i, slot, seq, header, start, hi - lo))
        landing.finish()  # the copies are over: now the slots say whether they hold
        for i, slot, seq, header, start, n in queued:
            whole = self.view[start : start + header.payload_len]
            bad = verify and checksum(whole) != header.checksum
            if not idx.unchanged(slot, seq):
                counters.inc("shm_direct_raced")
            elif bad:
                counters.inc("corrupt_transfers")
            else:
                out[i] = (True, n)
        return out

    def close(self) -> None:
        """Drop the index mapping (the segment belongs to its Segment)."""
        self.index.close()
