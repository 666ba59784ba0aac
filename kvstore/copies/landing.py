"""One block's bytes leaving a device hashed as they land, and arriving on one.

:func:`land_hashed` is the departure every block of the node makes when it leaves a
device (an HBM demotion or network read, a put of a CUDA tensor into DRAM): copied to
host memory in pieces, each piece hashed on the host as soon as its copy has landed
while the later ones are still in flight, so hashing costs about one piece more than
the copy itself (xxh3 fed piece by piece equals xxh3 of the whole). :func:`lift` is the
arrival: one H2D copy, waited for. Both run one batch of the copy engine (engine.py)
and finish it before they return, so nothing is in flight into the caller's memory
afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.blocks import checksum_stream
from kvstore.copies.engine import Batch, Completion, CopyEngine

__all__ = ["land_hashed", "lift", "pieces"]

_MIN_PIECE = 256 << 10  # below this a piece's event costs more than the overlap wins
_MAX_PIECES = 8


def pieces(n: int) -> list[tuple[int, int]]:
    """How a landing of ``n`` bytes is cut: at most 8 spans of at least 256 KiB (one
    span below 512 KiB), each a multiple of 4 KiB but the last."""
    if n <= 2 * _MIN_PIECE:
        return [(0, n)]
    size = max(_MIN_PIECE, -(-n // _MAX_PIECES))
    size = -(-size // 4096) * 4096
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def land_hashed(
    engine: CopyEngine,
    src: Any,
    dst: np.ndarray,
    *,
    pinned: bool,
    after_caller: bool = True,
    after_slab: bool = False,
) -> int:
    """Copy the flat uint8 device tensor ``src`` into the host array ``dst`` and return
    the xxh3 of what landed, hashing each piece while the later ones copy.

    ``pinned``: ``dst`` is page-locked (registered) memory the device writes at full
    speed, so every piece goes straight into it; otherwise each goes through one of
    two pinned staging buffers in turn and is copied into ``dst`` after it is hashed.
    The batch is ordered after the caller's stream and/or the engine's ordered stream
    as ``after_caller`` and ``after_slab`` say (:meth:`CopyEngine.begin`).
    """
    spans = pieces(int(dst.nbytes))
    with engine.begin(src.device, after_caller=after_caller, after_slab=after_slab) as batch:
        if pinned:
            return _straight(batch, spans, src, dst)
        return _staged(engine, batch, spans, src, dst)


def _straight(batch: Batch, spans: list[tuple[int, int]], src: Any, dst: np.ndarray) -> int:
    h = checksum_stream()
    marks: list[Completion] = []
    for a, b in spans:
        batch.d2h([dst[a:b]], [src[a:b]])
        marks.append(batch.mark())
    for (a, b), mark in zip(spans, marks, strict=True):
        mark.wait()
        h.update(dst[a:b])
    return int(h.intdigest())


def _staged(
    engine: CopyEngine, batch: Batch, spans: list[tuple[int, int]], src: Any, dst: np.ndarray
) -> int:
    h = checksum_stream()
    width = spans[0][1] - spans[0][0]
    stages = [engine.staging(width) for _ in range(min(2, len(spans)))]
    inflight: list[Completion] = []

    def queue(i: int) -> None:
        a, b = spans[i]
        batch.d2h([stages[i % len(stages)].part(b - a)], [src[a:b]])
        inflight.append(batch.mark())

    for i in range(len(stages)):
        queue(i)
    for i, (a, b) in enumerate(spans):
        inflight[i].wait()
        piece = stages[i % len(stages)].view[: b - a]
        h.update(piece)
        np.copyto(dst[a:b], piece)
        if i + len(stages) < len(spans):  # the stage is free again: its bytes are in dst
            queue(i + len(stages))
    return int(h.intdigest())


def lift(engine: CopyEngine, src: np.ndarray, dst: Any, *, pinned: bool) -> None:
    """Copy the host array ``src`` into the caller's flat uint8 device tensor ``dst``
    as one H2D on a side stream, ordered after the caller's stream, and wait for it
    (the caller's bytes may be freed once this returns). ``pinned``: ``src`` is
    page-locked and copied from as it is; otherwise it is staged once into pinned
    memory first."""
    n = int(src.nbytes)
    with engine.begin(dst.device) as batch:
        if pinned:
            batch.h2d([dst], [src])
        else:
            stage = engine.staging(n)
            np.copyto(stage.view[:n], src)
            batch.h2d([dst], [stage.part(n)])
