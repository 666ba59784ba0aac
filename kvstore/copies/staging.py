"""A ring of pinned staging buffers: the host fills (or drains) one while the stream
copies the others.

Used where a copy cannot DMA from the bytes' own memory: a client's TCP receive (the
socket writes into a staging buffer, then one H2D copy; the next block's receive
overlaps the previous block's copy), a put out of device tensors, and a mapping that
could not be registered with CUDA (the documented fallback of registry.py). A slot is
reused only after the event of its last copy has completed, so at most ``slots``
buffers are page-locked per call, whatever the batch's size.

Not thread-safe: a ring belongs to one call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.copies.engine import Batch, Completion, CopyEngine, Staged

__all__ = ["StagingRing"]


class _Slot:
    __slots__ = ("buf", "pending")

    def __init__(self) -> None:
        self.buf: Staged | None = None
        self.pending: Completion | None = None  # the last copy in or out of buf


class StagingRing:
    """``take(n)`` a buffer, fill it, ``upload`` it into a tensor (or ``download`` a
    tensor into it, then read it after the returned completion); ``drop`` a taken
    buffer that is not copied."""

    def __init__(self, engine: CopyEngine, slots: int = 4) -> None:
        if slots < 1:
            raise ValueError("a staging ring needs at least one slot")
        self.engine = engine
        self._slots = [_Slot() for _ in range(slots)]
        self._at = 0
        self._taken: _Slot | None = None
        self._n = 0

    def take(self, n: int) -> np.ndarray:
        """The next slot's buffer (``n`` bytes), once its previous copy is done."""
        if self._taken is not None:
            raise RuntimeError("the taken staging buffer was neither copied nor dropped")
        slot = self._slots[self._at]
        if slot.pending is not None:
            slot.pending.wait()
            slot.pending = None
        if slot.buf is None or slot.buf.view.size < n:
            slot.buf = self.engine.staging(n)
        self._taken, self._n = slot, n
        return slot.buf.view[:n]

    def upload(self, batch: Batch, dst: Any) -> Completion:
        """Queue the taken buffer's copy into ``dst`` (a flat uint8 tensor)."""
        slot = self._advance()
        assert slot.buf is not None
        batch.h2d([dst], [slot.buf.part(self._n)])
        slot.pending = batch.mark()
        return slot.pending

    def download(self, batch: Batch, src: Any) -> Completion:
        """Queue a copy of ``src`` (a flat uint8 tensor) into the taken buffer; read the
        buffer only after the returned completion, and before ``slots`` more takes."""
        slot = self._advance()
        assert slot.buf is not None
        batch.d2h([slot.buf.part(self._n)], [src])
        slot.pending = batch.mark()
        return slot.pending

    def drop(self) -> None:
        """Give the taken buffer back without a copy."""
        self._advance()

    def _advance(self) -> _Slot:
        slot = self._taken
        if slot is None:
            raise RuntimeError("no staging buffer is taken")
        self._taken = None
        self._at = (self._at + 1) % len(self._slots)
        return slot

    def close(self) -> None:
        """Wait for the copies still using the buffers, then let the buffers go (torch's
        caching host allocator keeps pinned ones for the next call)."""
        try:
            for slot in self._slots:
                if slot.pending is not None:
                    slot.pending.wait()
        finally:
            for slot in self._slots:
                slot.buf = slot.pending = None
            self._taken = None
