"""One engine step's loads from kvstore into vLLM's pages: whole blocks before the
forward, or layer by layer beside it.

A step's loads (every request's hits) go to the store as one batch per direction and
layer, chunked at ``max_blocks_per_call``, not one call per request. Layer-wise, a
background thread fetches layer 0 of every block (``get_into(..., layers=(0, 1))``),
writes it into layer 0's pages, marks it done, then layer 1, and so on; vLLM's attention
layer l waits for that mark alone (``wait``), so the forward starts as soon as layer 0
has landed and the rest of the transfer runs behind its compute. A range is verified
before it is written (kvstore's ranged-read contract), so a page never holds bytes
that failed their checksum.

Failures stay per block. A block that misses or fails on any layer is failed as a
whole, with every later block of its request, since vLLM recomputes a request from its
first missing block; the layers already written into its pages are recomputed too.
:meth:`StepLoad.outcome` says, per request, how many leading blocks were loaded.

With ``kv_codec`` (engine/vllm/compress.py) the stored bytes land in the codec's buffer
on the KV device and are decoded into the staging blocks before the scatter; such a
load is whole-block only (a compressed block has no layer ranges in the store). A block
whose bytes do not decode fails like a miss.

Concurrency: the loader thread writes only pages of the blocks being loaded, which the
forward reads but never writes; ``_done`` events order each layer's writes before the
attention that reads them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.blockstore import GuardedStore
from engine.vllm.compress import BlockCodec
from engine.vllm.paged import PagedKV

if TYPE_CHECKING:
    import torch

__all__ = ["BlockTransfer", "StepLoad"]

log = logging.getLogger("vllm.kvstore")


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move: ``keys[i]`` <-> vLLM page ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


class StepLoad:
    """The loads of one step, started at once; ``wait(layer)`` before that layer runs,
    ``outcome()`` after the forward."""

    def __init__(
        self,
        items: Sequence[BlockTransfer],
        store: GuardedStore,
        paged: PagedKV,
        chunk: int,
        executor: ThreadPoolExecutor | None,
        codec: BlockCodec | None = None,
    ) -> None:
        if codec is not None and executor is not None:
            raise ValueError("compressed blocks load whole: the store has no layers of them")
        self.items = list(items)
        self._keys = [k for it in self.items for k in it.keys]
        self._ids = [b for it in self.items for b in it.block_ids]
        self._ok = [True] * len(self._keys)
        self._store, self._paged, self._chunk = store, paged, chunk
        self._codec = codec
        layers = paged.layout.layers
        self._done = [threading.Event() for _ in range(layers)]
        self._future: Future[None] | None = None
        if executor is None:  # whole blocks, now, before the forward
            self._whole()
            for e in self._done:
                e.set()
        else:
            self._future = executor.submit(self._layerwise)

    # -- the transfer ---------------------------------------------------------------------

    def _whole(self) -> None:
        for start in range(0, len(self._keys), self._chunk):
            part = range(start, min(start + self._chunk, len(self._keys)))
            n = len(part)
            buf = self._paged.staging(n) if self._codec is None else self._codec.landing(n)
            self._fetch(part, buf, None, lambda got, ids: self._paged.scatter(got, ids))

    def _layerwise(self) -> None:
        try:
            for layer, done in enumerate(self._done):
                live = [i for i, ok in enumerate(self._ok) if ok]
                for start in range(0, len(live), self._chunk):
                    part = live[start : start + self._chunk]
                    buf = self._paged.layer_staging(len(part))

                    def write(got: torch.Tensor, ids: list[int], first: int = layer) -> None:
                        self._paged.scatter(got, ids, first_layer=first)

                    self._fetch(part, buf, (layer, layer + 1), write)
                done.set()
        except BaseException:
            log.exception("layer-wise load failed; its blocks are recomputed")
            self._ok = [False] * len(self._ok)
            raise
        finally:
            for e in self._done:  # a failure must not leave the forward waiting
                e.set()

    def _fetch(
        self,
        part: Sequence[int],
        buf: torch.Tensor,
        layers: tuple[int, int] | None,
        write: Callable[[torch.Tensor, list[int]], None],
    ) -> None:
        """Fetch ``part`` of the step's blocks into ``buf`` and write the hits."""
        outs = [buf[j] for j in range(len(part))]
        got = self._store.load([self._keys[i] for i in part], outs, layers=layers)
        hits = [j for j, ok in enumerate(got) if ok]
        for j, ok in enumerate(got):
            if not ok:
                self._ok[part[j]] = False
        if hits:
            sel = buf[hits] if len(hits) < len(part) else buf[: len(part)]
            if self._codec is not None:
                sel, hits = self._decode(part, sel, hits)
            if hits:
                write(sel, [self._ids[part[j]] for j in hits])

    def _decode(
        self, part: Sequence[int], raw: torch.Tensor, hits: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """The hits' stored bytes ``raw`` decoded into the staging blocks, and the hits
        that decoded (a block that does not fails like a miss)."""
        assert self._codec is not None
        out = self._paged.canon(len(part))[: len(hits)]  # where the codec runs
        ok = self._codec.decode(raw, out)
        if all(ok):
            return out, hits
        for j, good in zip(hits, ok, strict=True):
            if not good:
                self._ok[part[j]] = False
        keep = [k for k, good in enumerate(ok) if good]
        return out[keep], [hits[k] for k in keep]

    # -- the forward's side -------------------------------------------------------------

    def wait(self, layer: int) -> None:
        """Block until ``layer`` of every block has landed (or failed)."""
        self._done[layer].wait()

    def outcome(self) -> list[tuple[BlockTransfer, int]]:
        """Per request: how many leading blocks loaded (all layers). Waits for the
        transfer to end."""
        if self._future is not None:
            self._future.exception()  # waits; a failure was logged and failed every block
        out, i = [], 0
        for it in self.items:
            n = len(it.keys)
            ok = self._ok[i : i + n]
            out.append((it, ok.index(False) if False in ok else n))
            i += n
        return out

    def failed_keys(self) -> list[bytes]:
        """Keys that missed or failed a check (to drop from the store)."""
        return [k for k, ok in zip(self._keys, self._ok, strict=True) if not ok]
