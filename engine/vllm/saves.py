"""One engine step's saves from vLLM's pages into kvstore, layer by layer beside the
forward.

vLLM calls the connector's ``save_kv_layer`` after each attention layer has written
this step's KV into its pages. :class:`StepSave` gathers that layer of every block the
step completes out of the pages into the canonical layout, and a background thread
sends it to the store (kvstore's layer-by-layer write, kvstore/client/layered.py) while
the forward computes the next layers. Where the gather runs: on the forward's thread,
with its torch thread team, when the forward holds every core (a gather from another
thread would fight that team for them); in the saver thread when it has cores of its
own (engine/vllm/cpus.py), so the gather is hidden too. On a GPU the gather is
kernels on the forward's stream and a copy to pinned host memory queued behind them,
so the forward's thread never waits: the saver waits for that copy's event before it
sends the layer. ``finish``
(from ``wait_for_save``) waits for the last layer and commits: the blocks become
visible in the store once, whole, with one checksum each.

A request whose load failed in this step attended to pages that were never filled, so
its new blocks are withdrawn at the commit (``keep``), never stored. A layer vLLM did
not hand over (a model whose attention layers do not all call the hook) is gathered and
sent at ``finish``, so the write always covers every layer. A store that fails mid-way
costs this step's saves only: the write is aborted and nothing partial is visible.

Concurrency: the saver thread reads only the staging buffer, each layer of it after
the gather that filled it; the buffer is reused only by the next step, after
``finish`` has waited for the saver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.blockstore import GuardedStore, LayerWriter
from engine.vllm.loads import BlockTransfer
from engine.vllm.paged import PagedKV

__all__ = ["StepSave"]

log = logging.getLogger("vllm.kvstore")


class StepSave:
    """The saves of one step: ``layer(l)`` as each layer is computed, ``finish`` after
    the forward."""

    def __init__(
        self,
        items: Sequence[BlockTransfer],
        store: GuardedStore,
        paged: PagedKV,
        chunk: int,
        executor: ThreadPoolExecutor,
        *,
        gather_in_saver: bool = False,
    ) -> None:
        self.items = list(items)
        self._keys = [k for it in self.items for k in it.keys]
        self._ids = [b for it in self.items for b in it.block_ids]
        self._owner = [it.req_id for it in self.items for _ in it.keys]
        self._store, self._paged, self._chunk = store, paged, chunk
        self._layers = paged.layout.layers
        self._buf = paged.save_staging(len(self._keys))  # every layer, gathered as it comes
        self._next = 0  # layers handed to the saver thread
        self._writers: list[tuple[range, LayerWriter]] = []
        self._dead = False  # the store failed: nothing more is sent, nothing committed
        self._executor = executor
        self._gather_in_saver = gather_in_saver
        executor.submit(self._open)

    # -- the saver thread -------------------------------------------------------------

    def _open(self) -> None:
        shape, dtype = self._paged.block_shape, self._paged.dtype
        for start in range(0, len(self._keys), self._chunk):
            part = range(start, min(start + self._chunk, len(self._keys)))
            w = self._store.begin_save([self._keys[i] for i in part], shape=shape, dtype=dtype)
            if w is None:  # the store is down: this step saves nothing
                self._fail(None)
                return
            self._writers.append((part, w))

    def _gather(self, layer: int, *, blocking: bool = True) -> None:
        out = self._buf[layer : layer + 1].transpose(0, 1)  # [n, 1, ...] of the layer's run
        self._paged.gather_layer(self._ids, layer, out, blocking=blocking)

    def _send(
        self, layer: int, gather: bool = False, ready: Callable[[], None] | None = None
    ) -> None:
        if self._dead:
            return
        try:
            if gather:  # the buffers were made under the forward's inference mode
                with torch.inference_mode():
                    self._gather(layer)
            if ready is not None:  # a GPU's copy of the layer to the host, queued by the forward
                ready()
            for part, w in self._writers:
                w.write_stacked(layer, self._buf[layer : layer + 1, part.start : part.stop])
        except Exception as exc:
            self._fail(exc)

    def _commit(self, failed_reqs: set[str]) -> tuple[int, int, int]:
        if self._dead:
            return 0, 0, 0
        new = present = withdrawn = 0
        try:
            while self._writers:
                part, w = self._writers[0]
                keep = [self._owner[i] not in failed_reqs for i in part]
                for r in w.commit(keep):
                    new += r is True
                    present += r is False
                    withdrawn += r is None
                    if isinstance(r, Exception):
                        log.debug("kvstore refused a block: %s", r)
                self._writers.pop(0)
        except Exception as exc:
            self._fail(exc)
        return new, present, withdrawn

    def _fail(self, exc: Exception | None) -> None:
        self._dead = True
        if exc is not None:
            self._store.failed("save", exc)
        for _, w in self._writers:
            try:
                w.abort()
            except Exception:  # the write is gone either way; its error is not the news
                log.debug("aborting a layer-by-layer save raised", exc_info=True)
        self._writers = []

    # -- the forward's side -----------------------------------------------------------

    def layer(self, layer: int) -> None:
        """Layer ``layer`` is computed: have the saver thread send it (and any earlier
        layer not handed over), gathered out of the pages here, on the forward's
        thread, or by the saver when it has cores of its own (``gather_in_saver``)."""
        while self._next <= min(layer, self._layers - 1):
            li = self._next
            ready = None
            if not self._dead and not self._gather_in_saver:
                self._gather(li, blocking=False)  # a GPU's copy runs on behind the forward
                ready = self._paged.fence()
            self._executor.submit(self._send, li, self._gather_in_saver, ready)
            self._next += 1

    def finish(self, failed_reqs: set[str]) -> tuple[int, int, int]:
        """Send what is left, commit, and wait: (blocks stored, already present,
        withdrawn because their request's load failed)."""
        self.layer(self._layers - 1)
        return self._executor.submit(self._commit, set(failed_reqs)).result()
