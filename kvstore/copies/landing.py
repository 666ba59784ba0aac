"""One block's bytes leaving a device hashed as they land, and arriving on one.

:func:`land_hashed` is the departure every block of the node makes when it leaves a
device (an HBM demotion or network read, a put of a CUDA tensor into DRAM): copied to
host memory in pieces, each piece hashed on the host as soon as its copy has landed
while the later ones are still in flight, so hashing costs about one piece more than
the copy itself (xxh3 fed piece by piece equals xxh3 of the whole). :func:`lift` is the
arrival: one H2D copy, waited for. Both run one batch of the copy engine (engine.py)
and finish it before they return, so nothing is in flight into the caller's memory
afterwards. :func:`depart` and :func:`arrive` queue the same copies on a batch a caller
finishes (a node's batch of puts or reads: one submission, one wait).

Host memory is described by ``pinned``: False (pageable: copies go through pinned
staging), True (one page-locked allocation, a staging buffer), or the
:class:`~kvstore.copies.registry.Registration` it lies in (page-locked when that is
``pinned``): then every straight copy is cut where it crosses one of the registration's
chunk boundaries, so each piece lies in one cudaHostRegister'd chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.blocks import checksum, checksum_stream
from kvstore.copies.engine import Batch, Batches, Completion, CopyEngine, Staged
from kvstore.copies.registry import Registration

__all__ = [
    "Departure",
    "Pinned",
    "arrive",
    "cuts",
    "depart",
    "land_hashed",
    "lift",
    "locked",
    "pieces",
]

Pinned = bool | Registration
"""How host memory is page-locked (see the module docstring)."""

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


def locked(pinned: Pinned) -> bool:
    """Whether memory described by ``pinned`` is page-locked (copies go straight)."""
    return pinned.pinned if isinstance(pinned, Registration) else bool(pinned)


def cuts(pinned: Pinned, host: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
    """Bytes ``[a, b)`` of ``host`` as spans that each lie in one registered chunk (one
    span unless ``pinned`` is a Registration whose chunk boundary falls inside)."""
    if not isinstance(pinned, Registration) or b <= a:
        return [(a, b)]
    at = int(host.ctypes.data) + a
    return [(a + lo, a + hi) for lo, hi in pinned.pieces(at, b - a)]


def land_hashed(
    engine: CopyEngine,
    src: Any,
    dst: np.ndarray,
    *,
    pinned: Pinned,
    after_caller: bool = True,
    after_slab: bool = False,
) -> int:
    """Copy the flat uint8 device tensor ``src`` into the host array ``dst`` and return
    the xxh3 of what landed, hashing each piece while the later ones copy.

    ``pinned`` (the module docstring): when ``dst`` is page-locked the device writes
    every piece straight into it (cut at chunk boundaries); otherwise each goes through
    one of two pinned staging buffers in turn and is copied into ``dst`` once hashed.
    The batch is ordered after the caller's stream and/or the engine's ordered stream
    as ``after_caller`` and ``after_slab`` say (:meth:`CopyEngine.begin`).
    """
    spans = pieces(int(dst.nbytes))
    with engine.begin(src.device, after_caller=after_caller, after_slab=after_slab) as batch:
        if locked(pinned):
            return _straight(batch, spans, src, dst, pinned)
        return _staged(engine, batch, spans, src, dst)


def _straight(
    batch: Batch, spans: list[tuple[int, int]], src: Any, dst: np.ndarray, pinned: Pinned
) -> int:
    h = checksum_stream()
    marks: list[Completion] = []
    for a, b in spans:
        cs = cuts(pinned, dst, a, b)
        batch.d2h([dst[c:d] for c, d in cs], [src[c:d] for c, d in cs])
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


def lift(engine: CopyEngine, src: np.ndarray, dst: Any, *, pinned: Pinned) -> None:
    """Copy the host array ``src`` into the caller's flat uint8 device tensor ``dst``
    on a side stream, ordered after the caller's stream, and wait for it (the caller's
    bytes may be freed once this returns). Page-locked ``src`` (``pinned``) is copied
    from as it is, cut at chunk boundaries; otherwise it is staged once into pinned
    memory first."""
    with engine.begin(dst.device) as batch:
        stage = arrive(engine, batch, src, dst, pinned)
    del stage  # kept until the batch finished


def arrive(
    engine: CopyEngine, batch: Batch, src: np.ndarray, dst: Any, pinned: Pinned
) -> Staged | None:
    """Queue a copy of the host array ``src`` into the flat uint8 device tensor ``dst``
    on ``batch`` (see :func:`lift`); returns the staging buffer it went through, which
    must outlive the batch (None: straight from ``src``)."""
    n = int(src.nbytes)
    if locked(pinned):
        cs = cuts(pinned, src, 0, n)
        batch.h2d([dst[a:b] for a, b in cs], [src[a:b] for a, b in cs])
        return None
    stage = engine.staging(n)
    np.copyto(stage.view[:n], src)
    batch.h2d([dst], [stage.part(n)])
    return stage


class Departure:
    """One block's device-to-host copy queued on a call's batch (:func:`depart`)."""

    __slots__ = ("dst", "mark", "stage")

    def __init__(self, dst: np.ndarray, mark: Completion, stage: Staged | None) -> None:
        self.dst, self.mark, self.stage = dst, mark, stage

    def landed(self) -> int:
        """Wait for this block's own event (not the batch's later copies), then return
        the xxh3 of its bytes in host memory (a staged block is hashed in its staging
        buffer, then copied into ``dst``)."""
        self.mark.wait()
        stage, self.stage = self.stage, None
        if stage is None:
            return checksum(self.dst)
        view = stage.view[: self.dst.nbytes]
        h = checksum(view)
        np.copyto(self.dst, view)
        return h


def depart(
    engine: CopyEngine, batches: Batches, src: Any, dst: np.ndarray, pinned: Pinned
) -> Departure:
    """Queue the copy of the flat uint8 device tensor ``src`` into the host array
    ``dst`` on the call's batch for ``src``'s device, with an event of its own: straight
    when ``dst`` is page-locked (cut at chunk boundaries), else into a pinned staging
    buffer of its own that the call's batches keep until they finish. A batch of puts
    hashes block i (:meth:`Departure.landed`) while the copies after it still run."""
    batch = batches.on(engine, src.device)
    n = int(dst.nbytes)
    if locked(pinned):
        cs = cuts(pinned, dst, 0, n)
        batch.d2h([dst[a:b] for a, b in cs], [src[a:b] for a, b in cs])
        return Departure(dst, batch.mark(), None)
    stage = engine.staging(n)
    batches.keep(stage)
    batch.d2h([stage.part(n)], [src])
    return Departure(dst, batch.mark(), stage)
