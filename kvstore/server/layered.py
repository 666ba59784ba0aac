"""A write filled layer by layer: every block of a batch reserved at once, its payload
arriving one layer range at a time (layer 0 of every block, then layer 1, ...), and one
commit at the end.

Why: a prefill engine produces a block's KV one attention layer at a time. Sending each
layer as the forward pass produces it hides the save's transfer behind the rest of the
forward, where a whole-block put can only start after the last layer. The stored result
is exactly the block a whole put would store: one object, one xxh3 over all its layers,
checked once at the commit, so a reader never sees a block whose layers did not all
arrive. Nothing is visible before the commit; an abort (the writer went away, a layer
never came) releases every reservation.

The front ends drive it: the data socket receives each layer range straight into
:meth:`LayeredWrite.target` (the gateway asks the session's receiver for it,
kvstore/server/write_batch.py); an in-process caller copies into it. A block's layer
``l`` is the contiguous byte run ``[l * per, (l + 1) * per)`` of its payload (the layer
is the outermost dimension of a KV block, kvstore/blocks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.blocks import KIND_BYTES, ValueInfo
from kvstore.errors import InvalidValue, KVStoreError
from kvstore.node.store import Reservation

__all__ = ["LayeredWrite", "check_layered"]


def check_layered(info: ValueInfo, layers: int) -> None:
    """Refuse a value that does not split into ``layers`` equal, contiguous runs."""
    if info.kind == KIND_BYTES or not info.shape:
        raise InvalidValue("a layer-by-layer write needs a tensor block, not raw bytes")
    if info.shape[0] != layers:
        raise InvalidValue(f"block has {info.shape[0]} layers, the write sends {layers}")


class LayeredWrite:
    """The reservations of one layer-by-layer write request, in request order.

    ``slots[i]`` is item i's reservation, or None when it is refused (``results[i]``
    holds its error) or stored already (``results[i]`` False): its bytes still arrive
    and are dropped, so the stream stays in step.
    """

    def __init__(
        self,
        layers: int,
        sizes: Sequence[int],
        slots: list[Reservation | None],
        results: list[bool | KVStoreError | None],
        commit: Callable[[Reservation, int], bool],
        abort: Callable[[Reservation], None],
    ) -> None:
        self.layers = layers
        self.per_layer = [n // layers for n in sizes]
        self.slots = slots
        self.results = results
        self._commit, self._abort = commit, abort

    def target(self, item: int, layer: int) -> np.ndarray | None:
        """Where item ``item``'s layer ``layer`` goes (None: drop its bytes)."""
        res = self.slots[item]
        if res is None:
            return None
        per = self.per_layer[item]
        buf: Any = res.payload
        return buf[layer * per : (layer + 1) * per]

    def finish(self, sums: Sequence[tuple[int, bool]]) -> list[bool | KVStoreError | None]:
        """Commit each kept item against the writer's xxh3 of its whole payload and
        abort each withdrawn one (``keep`` False: the writer learned its bytes are not
        to be stored, e.g. the KV came from a load that failed). Per item: True stored,
        False stored already, None withdrawn, or its error."""
        if len(sums) != len(self.slots):
            raise InvalidValue(f"{len(sums)} checksums for {len(self.slots)} items")
        out = list(self.results)
        for i, (res, (csum, keep)) in enumerate(zip(self.slots, sums, strict=True)):
            if res is None:
                continue
            if not keep:
                self._abort(res)
                out[i] = None
                continue
            try:
                out[i] = self._commit(res, csum)
            except KVStoreError as exc:
                out[i] = exc
        return out

    def abort(self) -> None:
        """Release every reservation not yet ended (a cut-short stream); idempotent:
        aborting an ended reservation does nothing."""
        for res in self.slots:
            if res is not None:
                self._abort(res)
