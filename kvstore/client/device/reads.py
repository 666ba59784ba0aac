"""One read call's copies into device tensors.

Bytes in the node's segment, when the client's mapping of it is registered with CUDA,
are gathered per device and queued as one submission: the DMA reads them straight from
the segment, with no host copy and no host hash (the server verified each block's
xxh3 when it was committed; README.md, "Guarantees"). Everything else (a payload
arriving on the socket, a segment that could not be registered) lands in a staging ring
(kvstore/copies/staging.py) and is copied from there as it arrives, so the host's next
receive overlaps the previous copy.

``finish`` queues what is gathered and waits once per device batch. The caller decides
what a block's result is only after it: a direct read's slot check, a lease's expiry
check and the lease's release all come after the copies are done. A context manager:
leaving it by an exception still waits for every queued copy (and drops the CUDA error,
if any, behind the exception already raised), so no copy is in flight into a caller's
tensor, a leased extent or a staging buffer once the call is over.

Not thread-safe: one per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.copies.engine import Batches, CopyEngine, Finishing
from kvstore.copies.landing import cuts
from kvstore.copies.registry import Registration
from kvstore.copies.staging import StagingRing

__all__ = ["DeviceRead"]


class DeviceRead(Finishing):
    """Copies into flat uint8 tensors (``engine.flat(out)``) of one call."""

    def __init__(
        self,
        engine: CopyEngine,
        segment: np.ndarray | None = None,
        reg: Registration | None = None,
        slots: int = 4,
    ) -> None:
        self.engine = engine
        self.segment = segment  # the client's mapping of the node's segment, uint8
        self.reg = reg if reg is not None and reg.pinned else None
        self._slots = slots
        self._ring: StagingRing | None = None
        self._batches = Batches()
        self._gathered: dict[Any, tuple[list[Any], list[np.ndarray]]] = {}
        self.staged_bytes = 0  # bytes that went through staging (host copies or receives)
        self._finished = False

    def from_segment(self, dst: Any, offset: int, n: int) -> None:
        """Copy segment bytes ``[offset, offset + n)`` into ``dst``: gathered for one
        DMA submission when registered, else through staging (one host copy)."""
        assert self.segment is not None
        src = self.segment[offset : offset + n]
        reg = self.reg
        if reg is None:

            def fill(view: np.ndarray) -> bool:
                np.copyto(view, src)
                return True

            self.receive(dst, n, fill)
            return
        dsts, srcs = self._gathered.setdefault(dst.device, ([], []))
        pieces = cuts(reg, src, 0, n)  # one, unless it straddles two registered chunks
        if len(pieces) == 1:
            dsts.append(dst)
            srcs.append(src)
            return
        for lo, hi in pieces:
            dsts.append(dst[lo:hi])
            srcs.append(src[lo:hi])

    def receive(self, dst: Any, n: int, fill: Callable[[np.ndarray], bool]) -> bool:
        """Land ``n`` bytes that ``fill`` writes into a staging buffer, then queue their
        copy into ``dst``; False (nothing copied) when ``fill`` says they are bad."""
        if self._ring is None:
            self._ring = StagingRing(self.engine, self._slots)
        ring = self._ring
        view = ring.take(n)
        try:
            good = fill(view)
        except BaseException:
            ring.drop()
            raise
        if not good:
            ring.drop()
            return False
        ring.upload(self._batches.on(self.engine, dst.device), dst)
        self.staged_bytes += n
        return True

    def submit(self) -> None:
        """Queue the gathered segment copies now (one submission per device)."""
        gathered, self._gathered = self._gathered, {}
        for device, (dsts, srcs) in gathered.items():
            self._batches.on(self.engine, device).h2d(dsts, srcs)

    def finish(self) -> None:
        """Queue what is gathered and wait once per batch; idempotent. Raises
        DeviceError when a copy failed (then no tensor of the call is filled)."""
        if self._finished:
            return
        self._finished = True
        ring = self._ring
        steps = [self.submit, self._batches.finish] + ([ring.close] if ring else [])
        first: BaseException | None = None
        for step in steps:  # every step runs: no copy may stay in flight
            try:
                step()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first
