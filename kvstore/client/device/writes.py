"""One put call's copies out of device tensors, item by item as they land.

A same-host put copies each tensor device-to-host straight into the extent the server
reserved for it (the client's mapping of the segment, registered with CUDA); a put whose
segment is not registered, or that goes over the socket, copies into a ring of pinned
staging buffers instead. Either way the copies run on a side stream ordered after the
producer's stream by an event (begun once per device), each item gets its own event, and
:class:`DeviceWrite` yields the items in order as their events complete: the caller
hashes item i on the host (the server checks that xxh3 at commit) while item i + 1's
copy is still running.

Leaving the iteration early (an exception, a break) still waits for every queued copy
before the extents or staging buffers can be reused (``finish``, also on leaving ``with``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.copies.engine import Batches, Completion, CopyEngine, Finishing
from kvstore.copies.landing import cuts
from kvstore.copies.registry import Registration
from kvstore.copies.staging import StagingRing

__all__ = ["DeviceWrite"]


class DeviceWrite(Finishing):
    """Copies flat uint8 tensors ``srcs`` to the host: into ``segment[offsets[i]:]``
    when ``reg`` is pinned and ``offsets[i]`` is not None, else into staging."""

    def __init__(
        self,
        engine: CopyEngine,
        srcs: Sequence[Any],
        offsets: Sequence[int | None],
        segment: np.ndarray | None = None,
        reg: Registration | None = None,
        slots: int = 4,
    ) -> None:
        if len(srcs) != len(offsets):
            raise ValueError(f"{len(srcs)} tensors for {len(offsets)} offsets")
        self.engine = engine
        self.srcs = srcs
        self.offsets = offsets
        self.segment = segment
        self.reg = reg if reg is not None and reg.pinned and segment is not None else None
        self._ring = StagingRing(engine, slots)
        self._slots = slots
        self._batches = Batches()
        self._finished = False

    def items(self) -> Iterator[tuple[int, np.ndarray, bool]]:
        """``(i, host bytes of srcs[i], landed)`` in order, each once its copy is done:
        ``landed`` when the bytes are already in their extent; otherwise the view is a
        staging buffer, valid until the next item is asked for."""
        n = len(self.srcs)
        marks: list[Completion | None] = [None] * n
        views: list[np.ndarray | None] = [None] * n
        direct = [self.reg is not None and off is not None for off in self.offsets]
        for i in range(n):
            if direct[i]:
                views[i], marks[i] = self._into_segment(i)
        staged = [i for i in range(n) if not direct[i]]
        queued = 0

        def queue_next() -> None:
            nonlocal queued
            i = staged[queued]
            src = self.srcs[i]
            views[i] = self._ring.take(int(src.numel()))
            marks[i] = self._ring.download(self._batches.on(self.engine, src.device), src)
            queued += 1

        while queued < min(len(staged), self._slots):
            queue_next()
        for i in range(n):
            mark = marks[i]
            view = views[i]
            assert mark is not None and view is not None
            mark.wait()
            yield i, view, direct[i]
            if not direct[i] and queued < len(staged):
                queue_next()  # into the slot item i used: the caller is done with it

    def _into_segment(self, i: int) -> tuple[np.ndarray, Completion]:
        src, off, reg, seg = self.srcs[i], self.offsets[i], self.reg, self.segment
        assert off is not None and reg is not None and seg is not None
        n = int(src.numel())
        dst = seg[off : off + n]
        batch = self._batches.on(self.engine, src.device)
        pieces = cuts(reg, dst, 0, n)  # one, unless it straddles two registered chunks
        if len(pieces) == 1:
            batch.d2h([dst], [src])
        else:
            batch.d2h([dst[lo:hi] for lo, hi in pieces], [src[lo:hi] for lo, hi in pieces])
        return dst, batch.mark()

    def finish(self) -> None:
        """Wait for every queued copy (once per batch); idempotent."""
        if self._finished:
            return
        self._finished = True
        first: BaseException | None = None
        for step in (self._batches.finish, self._ring.close):  # both run, whatever fails
            try:
                step()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first
