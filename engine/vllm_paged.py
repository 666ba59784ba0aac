"""Copies between vLLM's paged KV tensors and kvstore blocks.

vLLM keeps one paged tensor per attention layer; kvstore keeps one object per block
holding every layer, ``[layers, 2, kv_heads, block_tokens, head_dim]`` (the contract in
DESIGN.md). This module is the only place that knows how a vLLM page is laid out, so
the connector moves whole blocks without caring which backend allocated them.

Supported page layout, the one vLLM's CPU attention backend allocates:
``[num_blocks, kv_heads, block_tokens, 2 * head_dim]``, whose memory per block and head
is a key tile followed by a value tile of ``block_tokens * head_dim`` elements each. The
value tile is ``[block_tokens, head_dim]``. The key tile depends on the kernel ISA: the
AVX-512 kernel (``vec``) stores it transposed, ``[head_dim, block_tokens]`` (measured
against transformers' KV for fp32 and bf16, head dims 32 and 64, blocks of 32 to 128
tokens). With ``keys_transposed`` the copy turns it back, so stored blocks are canonical
(token-major, equal to what engine/hf.py stores); without it the tiles are copied as
they are, and the caller must keep such blocks in a namespace of their own.

A gather is one ``index_select`` of whole pages per layer into a scratch buffer, then
two copies that reorder all layers at once (the key one transposing); a scatter is two
``index_copy_`` per layer. The cost does not depend on where vLLM put the pages (after
some traffic a request's pages are scattered: per-run copies were 3x slower then), and
both buffers are allocated and touched once: a fresh temporary per call is new memory,
whose first touch on CPU costs more than the copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["PagedKV"]


class PagedKV:
    """A model's paged KV tensors (one per layer, in layer order) seen as kvstore blocks.

    ``layout`` must carry the block size (``...:B32``); every tensor is checked against
    it at construction, so a wrong geometry fails at engine start, not mid-request.
    """

    def __init__(
        self, layers: Sequence[torch.Tensor], layout: KVLayout, *, keys_transposed: bool
    ) -> None:
        if layout.block_tokens is None:
            raise ConfigError("PagedKV needs a layout with a block size (:B<n>)")
        if len(layers) != layout.layers:
            raise ConfigError(f"{len(layers)} KV tensors for a {layout.layers}-layer layout")
        self.layout = layout
        self.block_shape = layout.block_shape()
        self.keys_transposed = keys_transposed
        for t in layers:
            _check_page_tensor(t, layout)
        H, B, D = layout.kv_heads, layout.block_tokens, layout.head_dim
        self.num_blocks = layers[0].shape[0]
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        key_tile = (D, B) if keys_transposed else (B, D)
        # Per layer: whole pages [blocks, H, 2, B*D]; key and value tiles as stored.
        self._pages = [t.view(t.shape[0], H, 2, B * D) for t in layers]
        self._keys = [p[:, :, 0].view(p.shape[0], H, *key_tile) for p in self._pages]
        self._values = [p[:, :, 1].view(p.shape[0], H, B, D) for p in self._pages]
        self._staging = torch.empty((0, *self.block_shape), dtype=self.dtype)
        self._scratch = torch.empty((len(layers), 0, H, 2, B * D), dtype=self.dtype)

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

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        return idx.to(self.device)

    def _key_order(self, t: torch.Tensor) -> torch.Tensor:
        """Canonical key tiles ``[..., B, D]`` seen in the pages' orientation."""
        return t.transpose(-1, -2) if self.keys_transposed else t

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks ``block_ids`` as ``[n, L, 2, H, B, D]`` (a view of the staging buffer,
        valid until the next gather or staging call)."""
        n = len(block_ids)
        out = self.staging(n)
        if n == 0:
            return out
        idx = self._index(block_ids)
        scratch = self._scratch[:, :n]  # [L, n, H, 2, B*D]
        for li, pages in enumerate(self._pages):
            torch.index_select(pages, 0, idx, out=scratch[li])
        L, _, H, _, _ = scratch.shape
        B, D = self.block_shape[3], self.block_shape[4]
        key_tile = (D, B) if self.keys_transposed else (B, D)
        # Both copies write through a permuted view and read contiguously (the fast way
        # round for a transposing copy on CPU: ~2.5x faster than the reverse).
        self._key_order(out[:, :, 0].transpose(0, 1)).copy_(
            scratch[:, :, :, 0].view(L, n, H, *key_tile)
        )
        out[:, :, 1].transpose(0, 1).copy_(scratch[:, :, :, 1].view(L, n, H, B, D))
        return out

    def scatter(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write ``blocks`` (``[n, L, 2, H, B, D]``) into the pages ``block_ids``."""
        if blocks.shape[0] != len(block_ids) or tuple(blocks.shape[1:]) != self.block_shape:
            raise ValueError(f"blocks {tuple(blocks.shape)} for {len(block_ids)} block ids")
        if not block_ids:
            return
        idx = self._index(block_ids)
        src = blocks.to(self.device)
        for li in range(len(self._pages)):
            self._keys[li].index_copy_(0, idx, self._key_order(src[:, li, 0]))
            self._values[li].index_copy_(0, idx, src[:, li, 1])


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
