"""Adapter between a transformers causal LM's DynamicCache and kvstore blocks.

A block holds one 16-token (``block_tokens``) slice of every layer's keys and values
as one tensor ``[layers, 2, kv_heads, block_tokens, head_dim]``: one object per
block, so a prefix of n blocks is n fetches whatever the model depth. The layout
fingerprint (dtype, layers, KV heads, head dim, block size) is part of the
namespace, so a different model or dtype computes different keys and can never
load this KV; a block that still arrives with the wrong geometry is refused by
the store's layout check.

With ``kv_codec`` (``"fp8"`` or ``"int8"``, see :mod:`kvstore.codec`) the namespace's
layout names the codec, so its keys and fingerprint differ from the uncompressed
namespace's, and :meth:`HFKVAdapter.put_block` / :meth:`HFKVAdapter.get_block` encode
before the store and decode after it: the store, the wire and every tier see only the
compressed bytes (and checksum them), and the engine sees its own dtype. A store that
still hands back bytes of the wrong size or kind raises, which the readers here treat
as a miss.

Only batch size 1 is handled: disaggregated workers process one request at a time
per adapter call, and batching happens above this layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.blockstore import BlockStore
from kvstore.codec import get_codec, normalize_codec
from kvstore.codec.base import KVCodec
from kvstore.errors import KVStoreError, LayoutMismatch
from kvstore.keys import BlockKey, Namespace, prefix_keys

__all__ = ["HFKVAdapter", "layout_of"]


def layout_of(
    config: Any, dtype: torch.dtype, block_tokens: int, rank: int = 0, codec: str | None = None
) -> str:
    """The layout string of a model's KV: ``bfloat16:L30:H3:D64:B16:R0``, with
    ``:Cint8`` (say) appended when its blocks are stored compressed."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    name = str(dtype).removeprefix("torch.")
    layout = f"{name}:L{text.num_hidden_layers}:H{kv_heads}:D{head_dim}:B{block_tokens}:R{rank}"
    codec = normalize_codec(codec)
    return layout if codec is None else f"{layout}:C{codec}"


class HFKVAdapter:
    """Cuts a DynamicCache into store blocks and rebuilds one from stored blocks."""

    def __init__(
        self,
        model: Any,
        *,
        model_id: str,
        block_tokens: int = 16,
        tenant: str = "default",
        kv_codec: str | None = None,
    ) -> None:
        self.model = model
        self.block_tokens = block_tokens
        self.dtype: torch.dtype = model.dtype
        layout = layout_of(model.config, self.dtype, block_tokens, codec=kv_codec)
        self.namespace = Namespace(model_id, layout, tenant)
        self.layout = self.namespace.kv_layout
        self.block_shape = self.layout.block_shape()  # the engine's block, whatever is stored
        self.codec: KVCodec | None = (
            None if self.layout.codec is None else get_codec(self.layout.codec)
        )
        self.stored_block_bytes = self.layout.block_bytes()  # what the store holds per block

    def keys(self, token_ids: Sequence[int] | torch.Tensor) -> list[BlockKey]:
        """Keys of the prompt's full blocks."""
        return prefix_keys(token_ids, self.block_tokens, self.namespace)

    def reusable_blocks(self, n_prompt_tokens: int, n_stored: int) -> int:
        """Stored blocks worth loading: never the whole prompt, so at least the last
        prompt token is recomputed (its logits give the first generated token)."""
        return max(0, min(n_stored, (n_prompt_tokens - 1) // self.block_tokens))

    def blocks_from_cache(self, cache: Any, start: int, stop: int) -> list[torch.Tensor]:
        """Blocks ``start..stop-1`` of a batch-1 cache as contiguous ``[L, 2, H, B, D]``."""
        B = self.block_tokens
        layers = cache.layers
        if len(layers) != self.layout.layers:
            raise LayoutMismatch(f"cache has {len(layers)} layers, layout {self.layout.layers}")
        out = []
        for j in range(start, stop):
            s = slice(j * B, (j + 1) * B)
            block = torch.empty(self.block_shape, dtype=self.dtype)
            for li, layer in enumerate(layers):
                block[li, 0].copy_(layer.keys[0, :, s, :])
                block[li, 1].copy_(layer.values[0, :, s, :])
            out.append(block)
        return out

    def span_blocks(self, cache: Any, start: int, stop: int) -> list[torch.Tensor]:
        """Tokens ``start..stop-1`` of a batch-1 cache as blocks, the last one zero-padded.

        How a request hands over KV that is not a full block of its own (the partial
        tail, or a full block whose stored copy is another computation's bytes): the
        padding keeps every stored object in the namespace's block shape, and the
        reader crops it (:meth:`cache_from_blocks` ``tokens=``).
        """
        B = self.block_tokens
        layers = cache.layers
        out = []
        for s0 in range(start, stop, B):
            s1 = min(s0 + B, stop)
            block = torch.zeros(self.block_shape, dtype=self.dtype)
            for li, layer in enumerate(layers):
                block[li, 0, :, : s1 - s0].copy_(layer.keys[0, :, s0:s1, :])
                block[li, 1, :, : s1 - s0].copy_(layer.values[0, :, s0:s1, :])
            out.append(block)
        return out

    def cache_from_blocks(self, blocks: torch.Tensor, tokens: int | None = None) -> Any:
        """A DynamicCache holding ``blocks`` (``[n, L, 2, H, B, D]``) as its prefix,
        cropped to its first ``tokens`` tokens when given (a padded last block)."""
        from transformers import DynamicCache

        n, L, _, H, B, D = blocks.shape
        t = n * B if tokens is None else tokens
        data = []
        for li in range(L):
            k = blocks[:, li, 0].permute(1, 0, 2, 3).reshape(1, H, n * B, D)[:, :, :t]
            v = blocks[:, li, 1].permute(1, 0, 2, 3).reshape(1, H, n * B, D)[:, :, :t]
            data.append((k.contiguous(), v.contiguous()))
        return DynamicCache(ddp_cache_data=data, config=self.model.config)

    def load_prefix(
        self, store: BlockStore, keys: Sequence[bytes], n_prompt_tokens: int
    ) -> tuple[int, Any]:
        """Fetch the longest stored, verified prefix; returns (blocks loaded, cache or None).

        Stops at the first block that is missing, corrupt or refused: a prefix is only
        reusable up to its first gap, and a cache may miss but never load wrong KV.
        """
        n = self.reusable_blocks(n_prompt_tokens, store.match_prefix(keys))
        if n == 0:
            return 0, None
        buf = torch.empty((n, *self.block_shape), dtype=self.dtype)
        # Compressed blocks land as bytes and decode in one call: a prefix's worth of
        # large operations instead of a few small ones per block.
        land = (
            buf
            if self.codec is None
            else torch.empty((n, self.stored_block_bytes), dtype=torch.uint8)
        )
        got = 0
        for i in range(n):
            try:
                ok = store.get_into(keys[i], land[i], namespace=self.namespace)
            except KVStoreError:
                ok = False
            if not ok:
                break
            got += 1
        if got and self.codec is not None:
            try:
                self.codec.decode(land[:got], buf[:got])
            except KVStoreError:  # a verified block with a bad scale: refuse the prefix
                got = 0
        if got == 0:
            return 0, None
        return got, self.cache_from_blocks(buf[:got])

    def store_blocks(self, store: BlockStore, keys: Sequence[bytes], cache: Any, start: int) -> int:
        """Write full blocks ``start..len(keys)-1`` from ``cache``; returns how many were new."""
        new = 0
        for j, block in enumerate(self.blocks_from_cache(cache, start, len(keys)), start):
            if self.put_block(store, keys[j], block):
                new += 1
        return new

    def put_block(self, store: BlockStore, key: bytes, block: torch.Tensor) -> bool:
        """Put one engine block under this namespace, compressed first when the layout
        says so (the store gets, checks and checksums the codec's bytes). True when new.

        Raises InvalidValue for a block the codec refuses (inf or nan): storing it
        would hand garbage to every reader of the prefix.
        """
        if self.codec is None:
            return store.put(key, block, namespace=self.namespace)
        data = self.codec.encode(block).cpu()
        return store.put(key, data.numpy().data, namespace=self.namespace)

    def get_block(
        self,
        store: BlockStore,
        key: bytes,
        out: torch.Tensor,
        *,
        staging: torch.Tensor | None = None,
    ) -> bool:
        """Read one block into ``out`` (the engine's dtype and block shape), decoding it
        when the layout is compressed. False on a miss; raises KVStoreError for bytes
        that do not fit (which callers here count as a miss, never as KV).

        ``staging`` (uint8, :attr:`stored_block_bytes`) lands the compressed bytes;
        one is allocated when not given.
        """
        if self.codec is None:
            return store.get_into(key, out, namespace=self.namespace)
        raw = (
            torch.empty(self.stored_block_bytes, dtype=torch.uint8) if staging is None else staging
        )
        if not store.get_into(key, raw, namespace=self.namespace):
            return False
        self.codec.decode(raw, out)
        return True
