"""Copies between vLLM's paged KV tensors and kvstore's canonical blocks.

The store holds every block in one layout whatever wrote it (DESIGN.md, "Canonical
layout"): ``[layers, 2, kv_heads, block_tokens, head_dim]`` in the namespace's dtype,
token-major, the same bytes engine/hf/adapter.py cuts from a transformers cache. So a block
written by a prefill engine on an AMX machine is read by a decode engine without AMX,
by the transformers adapter, and by a GPU engine. vLLM's attention kernels each arrange
a page differently (engine/vllm/page_order.py learns how from the kernel); this module
is the only place that moves bytes by that order.

A gather is one ``index_select`` of whole pages per layer into a scratch buffer, then
one reordering copy per key and value for all layers at once (or one indexed copy, for
an order without a structured path); a scatter is the reverse. The cost does not depend
on where vLLM put the pages, and the buffers are allocated and touched once: a fresh
temporary per call is new memory, whose first touch on CPU costs more than the copy.

A quantized cache (vLLM's fp8 ``kv_cache_dtype``) keeps its pages as bytes: blocks
are the layout's fp8 dtype (what the store is told), and every reordering copy runs on
byte views of pages and blocks alike, so no copy converts a value (and CPU torch,
which indexes no fp8 tensor, can run them).

Pages on a GPU: the scratch and the reordering run on the pages' device, and the host
staging buffers (what the store reads and writes) are pinned, so the one copy per
gather or scatter between them is a DMA of canonical bytes. A layer gathered on the
forward's thread is copied to the host without a host wait; :meth:`PagedKV.fence` is
what the thread that sends it waits on. A scatter returns once its bytes are in the
pages, whichever stream the forward runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.vllm.page_order import PageLayout, TileOrder, known_layouts, probe_page_layout
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["PageLayout", "PagedKV", "TileOrder", "known_layouts", "probe_page_layout"]


class PagedKV:
    """A model's paged KV tensors (one per layer, in layer order) seen as kvstore blocks.

    ``layout`` must carry the block size (``...:B32``); every tensor is checked against
    it at construction, so a wrong geometry fails at engine start, not mid-request.
    ``page`` is the kernel's order (``probe_page_layout``). The tensors may be strided
    views (vLLM keeps some layouts block-major in memory) except on the structured
    path, whose views need them contiguous.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, page: PageLayout) -> None:
        if layout.block_tokens is None:
            raise ConfigError("PagedKV needs a layout with a block size (:B<n>)")
        if len(layers) != layout.layers:
            raise ConfigError(f"{len(layers)} KV tensors for a {layout.layers}-layer layout")
        self.layout = layout
        self.page = page
        self.block_shape = layout.block_shape()
        for t in layers:
            _check_page_tensor(t, layout, contiguous=page.structured)
        H, B, D = layout.kv_heads, layout.block_tokens, layout.head_dim
        if page.index.numel() != 2 * B * D:
            raise ConfigError(f"page layout {page.name!r} is for another tile size")
        self.num_blocks = layers[0].shape[0]
        self.dtype: torch.dtype = getattr(torch, layout.dtype)  # the blocks' (the store's)
        self._raw = torch.uint8 if self.dtype in _FP8 else self.dtype  # the copies'
        self.device = layers[0].device
        if any(t.device != self.device for t in layers):
            raise ConfigError("vLLM's KV tensors are on more than one device")
        self._gpu = self.device.type == "cuda"  # host staging pinned, so DMA reaches it
        layers = [t.view(self._raw) for t in layers]
        self._layers = list(layers)  # [blocks, H, B, 2D], any strides
        # On the structured path, per layer: whole pages [blocks, H, 2, B*D], and each
        # region seen in its stored shape [blocks, H, *stored].
        self._pages: list[torch.Tensor] = []
        self._tiles: list[list[torch.Tensor]] = []
        if page.key is not None and page.value is not None:
            self._pages = [t.view(t.shape[0], H, 2, B * D) for t in layers]
            orders = (page.key, page.value)
            self._tiles = [
                [p[:, :, kv].view(p.shape[0], H, *orders[kv].stored) for p in self._pages]
                for kv in (0, 1)
            ]
        self._index = page.index.to(self.device)
        self._scatter_scratch = [self._on_device((0,), self._raw) for _ in range(2)]
        self._staging = self._on_host((0, *self.block_shape))
        self._layer_staging = self._on_host((0, 1, *self.block_shape[1:]))
        self._canon = self._on_device((0, *self.block_shape))
        self._scratch = self._on_device((len(layers), 0, H, 2, B * D), self._raw)
        self._save_staging = self._on_host((layout.layers, 0, *self.block_shape[1:]))
        self._save_scratch = self._on_device((1, 0, H, 2, B * D), self._raw)

    def _on_host(self, shape: tuple[int, ...]) -> torch.Tensor:
        # zeros (unlike empty) writes every page: first touch happens here, once.
        return torch.zeros(shape, dtype=self.dtype, pin_memory=self._gpu)

    def _on_device(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    def reserve(self, n: int) -> None:
        """Allocate and touch the buffers for ``n`` blocks now (at engine start), so the
        first request does not pay for fresh pages."""
        self.staging(n)

    def staging(self, n: int) -> torch.Tensor:
        """A host buffer of ``n`` blocks ``[n, L, 2, H, B, D]``, reused between calls."""
        if self._staging.shape[0] < n:
            self._staging = self._on_host((n, *self.block_shape))
            L, _, H, two, BD = self._scratch.shape
            self._scratch = self._on_device((L, n, H, two, BD), self._raw)
        return self._staging[:n]

    def canon(self, n: int) -> torch.Tensor:
        """A buffer of ``n`` canonical blocks on the pages' device (the staging buffer
        when that is the host): where a codec decodes before a scatter."""
        if not self._gpu:
            return self.staging(n)
        if self._canon.shape[0] < n:
            self._canon = self._on_device((n, *self.block_shape))
        return self._canon[:n]

    def layer_staging(self, n: int) -> torch.Tensor:
        """A host buffer of one layer of ``n`` blocks ``[n, 1, 2, H, B, D]``, reused:
        the layer-wise loader's own (it runs beside the forward, never beside a
        gather)."""
        if self._layer_staging.shape[0] < n:
            self._layer_staging = self._on_host((n, 1, *self.block_shape[1:]))
        return self._layer_staging[:n]

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        return idx.to(self.device)

    def gather(self, block_ids: Sequence[int], *, on_device: bool = False) -> torch.Tensor:
        """The blocks ``block_ids`` as ``[n, L, 2, H, B, D]``, canonical (a view of the
        staging buffer, valid until the next gather or staging call); ``on_device``:
        of :meth:`canon`'s, on the pages' device (what a codec encodes)."""
        n = len(block_ids)
        self.staging(n)  # sizes the scratch too
        out = self.canon(n) if on_device else self._staging[:n]
        return self._gather(block_ids, 0, out, self._scratch[:, :n])

    def save_staging(self, n: int) -> torch.Tensor:
        """The layer-wise saver's host buffer of ``n`` blocks, layer-major
        ``[L, n, 2, H, B, D]`` (each layer of every block one contiguous run, the order
        a layer-by-layer write sends), reused between steps (a step's saves end before
        the next step's start)."""
        if self._save_staging.shape[1] < n:
            L, rest = self.block_shape[0], self.block_shape[1:]
            self._save_staging = self._on_host((L, n, *rest))
        return self._save_staging[:, :n]

    def gather_layer(
        self,
        block_ids: Sequence[int],
        layer: int,
        out: torch.Tensor | None = None,
        *,
        blocking: bool = True,
    ) -> torch.Tensor:
        """Layer ``layer`` of the blocks as ``[n, 1, 2, H, B, D]``, canonical: into
        ``out`` (such a view, e.g. of :meth:`save_staging`) or a fresh tensor. Called
        on the forward's thread, whose torch thread team (CPU) or stream (GPU) it uses:
        a gather from another thread would fight the forward's team for the cores, or
        read pages the forward's stream has not written yet. ``blocking=False`` returns
        before a GPU's copy to the host is done: wait on a :meth:`fence` taken after."""
        if not 0 <= layer < self.block_shape[0]:
            raise ValueError(f"layer {layer} of {self.block_shape[0]}")
        n = len(block_ids)
        if out is None:
            out = self._on_host((n, 1, *self.block_shape[1:]))
        if self._save_scratch.shape[1] < n:
            H, BD = self._scratch.shape[2], self._scratch.shape[4]
            self._save_scratch = self._on_device((1, n, H, 2, BD), self._raw)
        scratch = self._save_scratch[:, :n]
        return self._gather(block_ids, layer, out, scratch, blocking=blocking)

    def fence(self) -> Callable[[], None]:
        """A wait for the work queued so far on the calling thread's stream (a GPU's
        copies of a gather); nothing to wait for on CPU."""
        if not self._gpu:
            return _nothing
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event.synchronize

    def _gather(
        self,
        block_ids: Sequence[int],
        first: int,
        out: torch.Tensor,
        scratch: torch.Tensor,
        *,
        blocking: bool = True,
    ) -> torch.Tensor:
        """Layers [first, first + k) of the blocks into ``out`` (``[n, k, 2, H, B, D]``),
        through ``scratch`` (``[k, n, H, 2, B*D]``, page order) and, for host ``out``
        of device pages, a canonical copy on the device."""
        n = len(block_ids)
        if out.dtype != self.dtype:  # a byte view would reinterpret it as another dtype
            raise ValueError(f"gathering pages of {self.dtype} into {out.dtype}")
        if n == 0:
            return out
        idx = self._ids(block_ids)
        dst = out if out.device == self.device else torch.empty_like(out, device=self.device)
        if self._pages:
            self._reorder_structured(idx, first, dst.view(self._raw), scratch)
        else:
            self._reorder_indexed(idx, first, dst.view(self._raw), scratch)
        if dst is not out:
            out.copy_(dst, non_blocking=not blocking)  # pinned: a DMA, queued in order
        return out

    def _reorder_structured(
        self, idx: torch.Tensor, first: int, out: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        L, n, H, _, _ = scratch.shape  # the layers gathered
        for li, pages in enumerate(self._pages[first : first + L]):
            torch.index_select(pages, 0, idx, out=scratch[li])
        key, value = self.page.key, self.page.value
        assert key is not None and value is not None
        # Write through a permuted view, read contiguously (the fast way round for a
        # reordering copy on CPU: ~2.5x faster than the reverse).
        for kv, order in ((0, key), (1, value)):
            dst = out[:, :, kv].transpose(0, 1).view(L, n, H, *order.split)
            dst.permute(0, 1, 2, *(3 + i for i in order.inverse)).copy_(
                scratch[:, :, :, kv].view(L, n, H, *order.stored)
            )

    def _reorder_indexed(
        self, idx: torch.Tensor, first: int, out: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        L, n, H, _, BD = scratch.shape
        B, D = self.block_shape[3], self.block_shape[4]
        for li, layer in enumerate(self._layers[first : first + L]):
            torch.index_select(layer, 0, idx, out=scratch[li].view(n, H, B, 2 * D))
        flat = scratch.view(L, n, H, 2 * BD).index_select(3, self._index)
        out.permute(1, 0, 3, 2, 4, 5).copy_(flat.view(L, n, H, 2, B, D))

    def scatter(
        self, blocks: torch.Tensor, block_ids: Sequence[int], *, first_layer: int = 0
    ) -> None:
        """Write canonical ``blocks`` (``[n, L, 2, H, B, D]``) into the pages ``block_ids``;
        with ``first_layer``, ``blocks`` holds layers [first_layer, first_layer + k).
        On a GPU it returns once the pages hold them (the forward may run on another
        stream than this thread's)."""
        k = blocks.shape[1] if blocks.dim() == 6 else -1
        if (
            blocks.shape[0] != len(block_ids)
            or tuple(blocks.shape[2:]) != self.block_shape[1:]
            or not 0 <= first_layer < first_layer + k <= self.block_shape[0]
        ):
            raise ValueError(
                f"blocks {tuple(blocks.shape)} from layer {first_layer} for "
                f"{len(block_ids)} block ids"
            )
        if not block_ids:
            return
        if blocks.dtype != self.dtype:  # a byte view would reinterpret another dtype
            raise ValueError(f"blocks of {blocks.dtype} for pages of {self.dtype}")
        idx = self._ids(block_ids)
        src = blocks.to(self.device).view(self._raw)
        if self._pages:
            self._scatter_structured(src, idx, first_layer)
        else:
            self._scatter_indexed(src, idx, first_layer)
        self.fence()()

    def _scatter_structured(self, src: torch.Tensor, idx: torch.Tensor, first: int) -> None:
        n, L, _, H, _, _ = src.shape
        key, value = self.page.key, self.page.value
        assert key is not None and value is not None
        for kv, order in ((0, key), (1, value)):
            staged = self._staged(kv, order, n)
            for li in range(L):
                tile = src[:, li, kv].reshape(n, H, *order.split)
                if staged is None:
                    stored = tile.permute(0, 1, *(2 + i for i in order.inverse))
                    self._tiles[kv][first + li].index_copy_(0, idx, stored)
                    continue
                # Short innermost runs (amx's 4-byte pairs): lay the tiles out in the
                # page's order first, through a permuted view written from a
                # contiguous read, then copy whole rows (1.4-1.8x faster on amx;
                # slower for vec's long runs, which keep the direct copy).
                staged.permute(0, 1, *(2 + p for p in order.perm)).copy_(tile)
                self._tiles[kv][first + li].index_copy_(0, idx, staged)

    def _scatter_indexed(self, src: torch.Tensor, idx: torch.Tensor, first: int) -> None:
        n, L, _, H, B, D = src.shape
        canon = src.permute(1, 0, 3, 2, 4, 5).reshape(L, n, H, 2 * B * D)
        page = torch.empty((n, H, 2 * B * D), dtype=self._raw, device=self.device)
        for li in range(L):
            # The probe saw every element of a page land once: the index covers the
            # page, so nothing of the old page needs reading.
            page.index_copy_(2, self._index, canon[li])
            self._layers[first + li].index_copy_(0, idx, page.view(n, H, B, 2 * D))

    def _staged(self, kv: int, order: TileOrder, n: int) -> torch.Tensor | None:
        """A reused ``[n, H, *stored]`` buffer for scattering tiles whose innermost run
        is under a cache line (None: copy directly). One scatter at a time: a step's
        loads run on the loader thread or before the forward, never both."""
        if order.stored[-1] * self._pages[0].element_size() >= 64:
            return None
        buf = self._scatter_scratch[kv]
        if buf.shape[0] < n:
            H = self._pages[0].shape[1]
            shape = (n, H, *order.stored)
            buf = torch.empty(shape, dtype=self._raw, device=self.device)
            self._scatter_scratch[kv] = buf
        return buf[:n]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _nothing() -> None:
    """A fence with nothing to wait for."""


def _check_page_tensor(t: torch.Tensor, layout: KVLayout, *, contiguous: bool) -> None:
    """Refuse a KV tensor that is not vLLM's logical page shape for ``layout``."""
    H, B, D = layout.kv_heads, layout.block_tokens, layout.head_dim
    named = str(t.dtype).removeprefix("torch.")
    fp8_bytes = t.dtype == torch.uint8 and getattr(torch, layout.dtype) in _FP8
    if named != layout.dtype and not fp8_bytes:  # vLLM keeps fp8 pages as uint8
        raise ConfigError(f"KV tensor dtype {t.dtype} but the layout says {layout.dtype}")
    if t.dim() != 4 or tuple(t.shape[1:]) != (H, B, 2 * D):
        raise ConfigError(
            f"unsupported vLLM KV page layout {tuple(t.shape)}: expected "
            f"[num_blocks, {H}, {B}, {2 * D}] (kv heads, block tokens, 2 x head dim)"
        )
    if contiguous and not t.is_contiguous():
        raise ConfigError("vLLM KV tensors must be contiguous for this kernel's page order")
