"""Copies between vLLM's paged KV tensors and kvstore's canonical blocks.

The store holds every block in one layout whatever wrote it (DESIGN.md, "Canonical
layout"): ``[layers, 2, kv_heads, block_tokens, head_dim]`` in the namespace's dtype,
token-major, the same bytes engine/hf/adapter.py cuts from a transformers cache. So a block
written by a prefill engine on an AMX machine is read by a decode engine without AMX,
by the transformers adapter, and by a GPU engine. vLLM's CPU attention kernels each
arrange a page differently; this module is the only place that knows how.

The page: vLLM's CPU backend allocates one tensor per layer,
``[num_blocks, kv_heads, block_tokens, 2 * head_dim]``, and views each page and head as
a key region followed by a value region of ``block_tokens * head_dim`` elements
(cpu_attn.py: ``view(n, H, 2B, D).chunk(2, dim=2)``). Inside a region the kernel's
``reshape_and_cache`` decides the order:

- ``vec`` / ``vec16`` (AVX-512, AVX2, generic): the key tile transposed, ``[D, B]``;
  the value tile token-major, ``[B, D]``.
- ``amx`` (bf16 on AMX): tiles packed for AMX B-matrices, in 4-byte pairs of elements
  (p = 4 / itemsize): keys as ``[B/16, D/p, 16, p]`` (16-token groups of head-dim
  pairs), values as ``[D/16, B/p, 16, p]`` (16-dim groups of token pairs).

Those orders are not trusted from this table: ``probe_page_layout`` runs the kernel's own
``reshape_and_cache`` on tokens whose every element has a distinct bit pattern, reads
where each one landed, and picks the table entry that agrees (a fast structured copy).
A kernel this table does not know (NEON, VSX, RVV, a future change) gets the generic
path: a per-element index derived from the same probe. A kernel the probe cannot map
is refused at engine start, so a store never receives bytes in an unknown order.

A gather is one ``index_select`` of whole pages per layer into a scratch buffer, then
one reordering copy per key and value for all layers at once; a scatter is the reverse.
The cost does not depend on where vLLM put the pages, and both buffers are allocated
and touched once: a fresh temporary per call is new memory, whose first touch on CPU
costs more than the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["PageLayout", "PagedKV", "TileOrder", "known_layouts", "probe_page_layout"]

# The kernel's reshape_and_cache: (key, value, key_cache, value_cache, slot_mapping),
# with key/value [tokens, heads, head_dim] and the caches vLLM's per-region views.
PageWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_AMX_GROUP = 16  # AMX B-matrix tiles: 16 columns of 4-byte words


@dataclass(frozen=True)
class TileOrder:
    """How one head's key (or value) tile sits in its page region.

    The region holds the tile as a contiguous tensor of shape ``stored``; permuting it
    by ``perm`` gives the canonical ``[B, D]`` tile with B and D split into factors
    (``split``), so that a plain ``view`` reaches it from either side.
    """

    stored: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def split(self) -> tuple[int, ...]:
        """The canonical tile's shape in the permuted order (B's factors, then D's)."""
        return tuple(self.stored[p] for p in self.perm)

    @property
    def inverse(self) -> tuple[int, ...]:
        """The permutation that takes the split canonical tile back to ``stored``."""
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return tuple(inv)

    def positions(self) -> torch.Tensor:
        """For each canonical element (token-major), its offset inside the region."""
        n = 1
        for s in self.stored:
            n *= s
        return torch.arange(n).view(self.stored).permute(self.perm).reshape(n)


@dataclass(frozen=True)
class PageLayout:
    """The order of one page and head: a key region then a value region.

    ``index[c]`` is where canonical element ``c`` lives in the head's ``2 * B * D``
    elements (keys ``[B, D]`` then values ``[B, D]``, token-major). ``key`` and ``value``
    are set when a structured order matches, which copies faster than the index.
    """

    name: str
    index: torch.Tensor
    key: TileOrder | None = None
    value: TileOrder | None = None

    @property
    def structured(self) -> bool:
        """Whether gather and scatter take the structured (view and copy) path."""
        return self.key is not None and self.value is not None


def known_layouts(block_tokens: int, head_dim: int, itemsize: int) -> list[PageLayout]:
    """The structured page orders of vLLM's CPU kernels that fit this geometry."""
    B, D = block_tokens, head_dim
    out = []

    def add(name: str, key: TileOrder, value: TileOrder) -> None:
        index = torch.cat([key.positions(), value.positions() + B * D])
        out.append(PageLayout(name, index, key, value))

    add("vec", TileOrder((D, B), (1, 0)), TileOrder((B, D), (0, 1)))  # vec and vec16
    p = 4 // itemsize if itemsize in (1, 2, 4) else 0
    if p and B % _AMX_GROUP == 0 and B % p == 0 and D % p == 0 and D % _AMX_GROUP == 0:
        g = _AMX_GROUP
        add(
            "amx",
            TileOrder((B // g, D // p, g, p), (0, 2, 1, 3)),
            TileOrder((D // g, B // p, g, p), (1, 3, 0, 2)),
        )
    return out


def probe_page_layout(write: PageWriter, dtype: torch.dtype, layout: KVLayout) -> PageLayout:
    """Learn a kernel's page order from the kernel itself.

    ``write`` is the kernel's reshape_and_cache. One page is filled with keys and
    values whose elements carry their own canonical offset ``t * D + d`` as a bit
    pattern (no arithmetic touches them: the kernels copy whole words), then read back;
    keys first, then values.
    A structured order that agrees wins; otherwise the probed index is used as it is.
    Raises ConfigError unless every element landed exactly once in its own region.
    """
    if layout.block_tokens is None:
        raise ConfigError("probing a page layout needs a block size (:B<n>)")
    B, D = layout.block_tokens, layout.head_dim
    n = B * D
    itemsize = torch.empty((), dtype=dtype).element_size()
    int_type = {2: torch.int16, 4: torch.int32}.get(itemsize)
    if int_type is None or n >= 1 << (8 * itemsize):
        raise ConfigError(f"cannot probe vLLM pages of {dtype} with {B}x{D} tiles")
    bits = (1 << (8 * itemsize)) - 1
    # Two's-complement wrap keeps each offset's low bits: the bit pattern is the offset.
    offsets = torch.arange(n, dtype=torch.int64).view(B, 1, D).to(torch.int32).to(int_type)
    blank = torch.full_like(offsets, -1)  # all ones: no offset's pattern
    slots = torch.arange(B, dtype=torch.long)
    index = torch.empty(2 * n, dtype=torch.int64)
    # Keys and values are probed one at a time, so a kernel that swapped the two
    # regions (or wrote one into both) is caught rather than mapped.
    for region, (key, value) in enumerate(((offsets, blank), (blank, offsets))):
        kv = torch.full((1, 1, B, 2 * D), -1, dtype=int_type)
        key_cache, value_cache = kv.view(dtype).view(1, 1, 2 * B, D).chunk(2, dim=2)
        write(key.view(dtype).clone(), value.view(dtype).clone(), key_cache, value_cache, slots)
        page = kv.view(2, n).to(torch.int64) & bits
        values, order = torch.sort(page[region])
        if not torch.equal(values, torch.arange(n)) or bool((page[1 - region] != bits).any()):
            raise ConfigError(
                "vLLM's attention kernel stored a probe page in an order the KV connector "
                "cannot map (elements lost, doubled or moved between keys and values); "
                "refusing to store its pages"
            )
        index[region * n : (region + 1) * n] = order + region * n
    for known in known_layouts(B, D, itemsize):
        if torch.equal(known.index, index):
            return known
    return PageLayout("probed", index)


class PagedKV:
    """A model's paged KV tensors (one per layer, in layer order) seen as kvstore blocks.

    ``layout`` must carry the block size (``...:B32``); every tensor is checked against
    it at construction, so a wrong geometry fails at engine start, not mid-request.
    ``page`` is the kernel's order (``probe_page_layout``).
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
            _check_page_tensor(t, layout)
        H, B, D = layout.kv_heads, layout.block_tokens, layout.head_dim
        if page.index.numel() != 2 * B * D:
            raise ConfigError(f"page layout {page.name!r} is for another tile size")
        self.num_blocks = layers[0].shape[0]
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        # Per layer: whole pages [blocks, H, 2, B*D] and, on the structured path, each
        # region seen in its stored shape [blocks, H, *stored].
        self._pages = [t.view(t.shape[0], H, 2, B * D) for t in layers]
        self._tiles: list[list[torch.Tensor]] = []
        if page.key is not None and page.value is not None:
            orders = (page.key, page.value)
            self._tiles = [
                [p[:, :, kv].view(p.shape[0], H, *orders[kv].stored) for p in self._pages]
                for kv in (0, 1)
            ]
        self._index = page.index.to(self.device)
        self._scatter_scratch = [torch.empty(0, dtype=self.dtype) for _ in range(2)]
        self._staging = torch.empty((0, *self.block_shape), dtype=self.dtype)
        self._layer_staging = torch.empty((0, 1, *self.block_shape[1:]), dtype=self.dtype)
        self._scratch = torch.empty((len(layers), 0, H, 2, B * D), dtype=self.dtype)
        self._save_staging = torch.empty(
            (layout.layers, 0, *self.block_shape[1:]), dtype=self.dtype
        )
        self._save_scratch = torch.empty((1, 0, H, 2, B * D), dtype=self.dtype)

    def reserve(self, n: int) -> None:
        """Allocate and touch the buffers for ``n`` blocks now (at engine start), so the
        first request does not pay for fresh pages."""
        self.staging(n)

    def staging(self, n: int) -> torch.Tensor:
        """A host buffer of ``n`` blocks ``[n, L, 2, H, B, D]``, reused between calls."""
        if self._staging.shape[0] < n:
            # zeros (unlike empty) writes every page: first touch happens here, once.
            self._staging = torch.zeros((n, *self.block_shape), dtype=self.dtype)
            L, _, H, two, BD = self._scratch.shape
            self._scratch = torch.zeros((L, n, H, two, BD), dtype=self.dtype)
        return self._staging[:n]

    def layer_staging(self, n: int) -> torch.Tensor:
        """A host buffer of one layer of ``n`` blocks ``[n, 1, 2, H, B, D]``, reused:
        the layer-wise loader's own (it runs beside the forward, never beside a
        gather)."""
        if self._layer_staging.shape[0] < n:
            self._layer_staging = torch.zeros((n, 1, *self.block_shape[1:]), dtype=self.dtype)
        return self._layer_staging[:n]

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        return idx.to(self.device)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks ``block_ids`` as ``[n, L, 2, H, B, D]``, canonical (a view of the
        staging buffer, valid until the next gather or staging call)."""
        n = len(block_ids)
        out = self.staging(n)
        return self._gather(block_ids, 0, out, self._scratch[:, :n])

    def save_staging(self, n: int) -> torch.Tensor:
        """The layer-wise saver's host buffer of ``n`` blocks, layer-major
        ``[L, n, 2, H, B, D]`` (each layer of every block one contiguous run, the order
        a layer-by-layer write sends), reused between steps (a step's saves end before
        the next step's start)."""
        if self._save_staging.shape[1] < n:
            L, rest = self.block_shape[0], self.block_shape[1:]
            self._save_staging = torch.zeros((L, n, *rest), dtype=self.dtype)
        return self._save_staging[:, :n]

    def gather_layer(
        self, block_ids: Sequence[int], layer: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``layer`` of the blocks as ``[n, 1, 2, H, B, D]``, canonical: into
        ``out`` (such a view, e.g. of :meth:`save_staging`) or a fresh tensor. Called
        on the forward's thread, whose torch thread team it uses (a gather from another
        thread would fight the forward's team for the cores)."""
        if not 0 <= layer < self.block_shape[0]:
            raise ValueError(f"layer {layer} of {self.block_shape[0]}")
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, 1, *self.block_shape[1:]), dtype=self.dtype)
        if self._save_scratch.shape[1] < n:
            H, BD = self._scratch.shape[2], self._scratch.shape[4]
            self._save_scratch = torch.zeros((1, n, H, 2, BD), dtype=self.dtype)
        return self._gather(block_ids, layer, out, self._save_scratch[:, :n])

    def _gather(
        self, block_ids: Sequence[int], first: int, out: torch.Tensor, scratch: torch.Tensor
    ) -> torch.Tensor:
        """Layers [first, first + k) of the blocks into ``out`` (``[n, k, 2, H, B, D]``),
        through ``scratch`` (``[k, n, H, 2, B*D]``, page order)."""
        n = len(block_ids)
        if n == 0:
            return out
        idx = self._ids(block_ids)
        L = scratch.shape[0]  # the layers gathered
        for li, pages in enumerate(self._pages[first : first + L]):
            torch.index_select(pages, 0, idx, out=scratch[li])
        _, _, H, _, BD = scratch.shape
        B, D = self.block_shape[3], self.block_shape[4]
        key, value = self.page.key, self.page.value
        if key is not None and value is not None:
            # Write through a permuted view, read contiguously (the fast way round for
            # a reordering copy on CPU: ~2.5x faster than the reverse).
            for kv, order in ((0, key), (1, value)):
                dst = out[:, :, kv].transpose(0, 1).view(L, n, H, *order.split)
                dst.permute(0, 1, 2, *(3 + i for i in order.inverse)).copy_(
                    scratch[:, :, :, kv].view(L, n, H, *order.stored)
                )
            return out
        flat = scratch.view(L, n, H, 2 * BD).index_select(3, self._index)
        out.permute(1, 0, 3, 2, 4, 5).copy_(flat.view(L, n, H, 2, B, D))
        return out

    def scatter(
        self, blocks: torch.Tensor, block_ids: Sequence[int], *, first_layer: int = 0
    ) -> None:
        """Write canonical ``blocks`` (``[n, L, 2, H, B, D]``) into the pages ``block_ids``;
        with ``first_layer``, ``blocks`` holds layers [first_layer, first_layer + k)."""
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
        idx = self._ids(block_ids)
        src = blocks.to(self.device)
        n, L, _, H, B, D = src.shape
        key, value = self.page.key, self.page.value
        if key is not None and value is not None:
            for kv, order in ((0, key), (1, value)):
                staged = self._staged(kv, order, n)
                for li in range(L):
                    tile = src[:, li, kv].reshape(n, H, *order.split)
                    if staged is None:
                        stored = tile.permute(0, 1, *(2 + i for i in order.inverse))
                        self._tiles[kv][first_layer + li].index_copy_(0, idx, stored)
                        continue
                    # Short innermost runs (amx's 4-byte pairs): lay the tiles out in the
                    # page's order first, through a permuted view written from a
                    # contiguous read, then copy whole rows (1.4-1.8x faster on amx;
                    # slower for vec's long runs, which keep the direct copy).
                    staged.permute(0, 1, *(2 + p for p in order.perm)).copy_(tile)
                    self._tiles[kv][first_layer + li].index_copy_(0, idx, staged)
            return
        canon = src.permute(1, 0, 3, 2, 4, 5).reshape(L, n, H, 2 * B * D)
        for li in range(L):
            pages = self._pages[first_layer + li]
            page = pages.index_select(0, idx).view(n, H, 2 * B * D)
            page.index_copy_(2, self._index, canon[li])
            pages.index_copy_(0, idx, page.view(n, H, 2, B * D))

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
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._scatter_scratch[kv] = buf
        return buf[:n]


def _check_page_tensor(t: torch.Tensor, layout: KVLayout) -> None:
    """Refuse a KV tensor that is not the CPU backend's page layout for ``layout``."""
    H, B, D = layout.kv_heads, layout.block_tokens, layout.head_dim
    if str(t.dtype).removeprefix("torch.") != layout.dtype:
        raise ConfigError(f"KV tensor dtype {t.dtype} but the layout says {layout.dtype}")
    if t.dim() != 4 or tuple(t.shape[1:]) != (H, B, 2 * D):
        raise ConfigError(
            f"unsupported vLLM KV page layout {tuple(t.shape)}: expected the CPU backend's "
            f"[num_blocks, {H}, {B}, {2 * D}] (kv heads, block tokens, 2 x head dim)"
        )
    if not t.is_contiguous():
        raise ConfigError("vLLM KV tensors must be contiguous")
