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

Any device: every tensor made here (blocks, staging, landing buffers, rebuilt caches)
is made on the model's device (:func:`model_device`), so a model on ``cuda`` never sees
a CPU index or a host round trip, and a model on ``cpu`` runs the very same code (the
CPU tests cover the path a GPU runs). A prefix moves as one batch (engine/hf/blockio.py):

- written: its blocks are gathered on the device into one contiguous staging tensor
  ``[n, L, 2, H, B, D]`` (two strided copies per layer, not one per block and layer),
  and its rows go to the store in one ``batch_put``;
- read: one ``batch_get_into`` lands every block in a row of one contiguous tensor on
  the device, and the DynamicCache is rebuilt from it there, one copy per layer's keys
  and values, never through per-layer host copies; a compressed prefix lands as bytes
  and is decoded straight into the cache's tensors (:meth:`HFKVAdapter.load_cache`).

Only batch size 1 is handled: disaggregated workers process one request at a time
per adapter call, and batching happens above this layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.blockstore import BlockStore
from engine.hf.blockio import get_prefix_into, matched_blocks, put_batch
from kvstore.codec import get_codec, normalize_codec
from kvstore.codec.base import KVCodec
from kvstore.errors import KVStoreError, LayoutMismatch
from kvstore.keys import BlockKey, Namespace, prefix_keys

__all__ = ["HFKVAdapter", "layout_of", "model_device"]


def model_device(model: Any) -> torch.device:
    """Where a model's weights live: the device every tensor the engine makes goes to."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    for p in model.parameters():
        return torch.device(p.device)
    return torch.device("cpu")


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
    """Cuts a DynamicCache into store blocks and rebuilds one from stored blocks, on the
    model's device (:attr:`device`)."""

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
        self.device = model_device(model)
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

    def input_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """A batch-1 ``[1, len(ids)]`` id tensor on the model's device."""
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def reusable_blocks(self, n_prompt_tokens: int, n_stored: int) -> int:
        """Stored blocks worth loading: never the whole prompt, so at least the last
        prompt token is recomputed (its logits give the first generated token)."""
        return max(0, min(n_stored, (n_prompt_tokens - 1) // self.block_tokens))

    # -- cache -> blocks ----------------------------------------------------------------

    def gather(self, cache: Any, start: int, stop: int) -> torch.Tensor:
        """Full blocks ``start..stop-1`` of a batch-1 cache as one contiguous staging
        tensor ``[n, L, 2, H, B, D]`` on the device (its rows are the blocks)."""
        B = self.block_tokens
        return self.gather_tokens(cache, start * B, stop * B)

    def gather_tokens(self, cache: Any, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start..stop-1`` of a batch-1 cache as one contiguous staging tensor
        of blocks ``[n, L, 2, H, B, D]`` on the device, the last one zero-padded.

        How a request hands over KV that is not a full block of its own (the partial
        tail, or a full block whose stored copy is another computation's bytes): the
        padding keeps every stored object in the namespace's block shape, and the
        reader crops it (:meth:`cache_from_blocks` ``tokens=``). Each layer's keys and
        values go in with one strided copy for the full blocks (and one for a partial
        tail), so the copies per prefix scale with the depth, not with its length.
        """
        B = self.block_tokens
        layers = cache.layers
        if len(layers) != self.layout.layers:
            raise LayoutMismatch(f"cache has {len(layers)} layers, layout {self.layout.layers}")
        full, rest = divmod(max(stop - start, 0), B)
        n = full + (rest > 0)
        staging = torch.empty((n, *self.block_shape), dtype=self.dtype, device=self.device)
        if rest:
            staging[full].zero_()
        for li, layer in enumerate(layers):
            for kv, src in ((0, layer.keys), (1, layer.values)):
                x = src[0, :, start:stop]  # [H, t, D]
                if full:
                    blocks = x[:, : full * B].unflatten(1, (full, B)).transpose(0, 1)
                    staging[:full, li, kv].copy_(blocks)
                if rest:
                    staging[full, li, kv, :, :rest].copy_(x[:, full * B :])
        return staging

    def blocks_from_cache(self, cache: Any, start: int, stop: int) -> list[torch.Tensor]:
        """Blocks ``start..stop-1`` of a batch-1 cache, each ``[L, 2, H, B, D]``: the rows
        of one :meth:`gather` staging tensor."""
        return list(self.gather(cache, start, stop).unbind(0))

    def span_blocks(self, cache: Any, start: int, stop: int) -> list[torch.Tensor]:
        """Tokens ``start..stop-1`` as blocks, the last zero-padded: the rows of one
        :meth:`gather_tokens` staging tensor."""
        return list(self.gather_tokens(cache, start, stop).unbind(0))

    # -- blocks -> cache ----------------------------------------------------------------

    def cache_from_blocks(self, blocks: torch.Tensor, tokens: int | None = None) -> Any:
        """A DynamicCache holding ``blocks`` (``[n, L, 2, H, B, D]``) as its prefix,
        cropped to its first ``tokens`` tokens when given (a padded last block), on
        ``blocks``' device: one copy per layer's keys and values (and one more for a
        cropped tail), straight into tensors of the cropped size."""

        n, L, _, H, B, D = blocks.shape
        t = n * B if tokens is None else tokens
        if not 0 <= t <= n * B:
            raise ValueError(f"{t} tokens do not fit {n} blocks of {B}")
        full, rest = divmod(t, B)
        data = []
        for li in range(L):
            pair = []
            for kv in (0, 1):
                x = torch.empty((1, H, t, D), dtype=blocks.dtype, device=blocks.device)
                if full:
                    x[0, :, : full * B].unflatten(1, (full, B)).copy_(
                        blocks[:full, li, kv].transpose(0, 1)
                    )
                if rest:
                    x[0, :, full * B :].copy_(blocks[full, li, kv, :, :rest])
                pair.append(x)
            data.append((pair[0], pair[1]))
        return self._cache(data)

    # -- through a store ----------------------------------------------------------------

    def fetch_blocks(self, store: BlockStore, keys: Sequence[bytes]) -> tuple[int, torch.Tensor]:
        """Read ``keys`` as one batch into one contiguous ``[n, L, 2, H, B, D]`` tensor on
        the device; returns (leading blocks that arrived, the tensor). Compressed blocks
        land as bytes on the device and decode there in one call for the prefix.

        Stops at the first block that is missing, corrupt or refused; rows past the
        count are not KV and must not be used.
        """
        n = len(keys)
        buf = torch.empty((n, *self.block_shape), dtype=self.dtype, device=self.device)
        if n == 0:
            return 0, buf
        if self.codec is None:
            return get_prefix_into(store, keys, list(buf.unbind(0)), self.namespace), buf
        land = torch.empty((n, self.stored_block_bytes), dtype=torch.uint8, device=self.device)
        got = get_prefix_into(store, keys, list(land.unbind(0)), self.namespace)
        if got:
            try:
                self.codec.decode(land[:got], buf[:got])
            except KVStoreError:  # a verified block with a bad scale: refuse the prefix
                got = 0
        return got, buf

    def load_cache(
        self, store: BlockStore, keys: Sequence[bytes], tokens: int | None = None
    ) -> tuple[int, Any]:
        """Read ``keys`` as one batch and rebuild a DynamicCache from the leading blocks
        that arrived: (blocks, cache), the cache None when none did. ``tokens`` crops it
        when every block arrived (a zero-padded last block).

        Uncompressed blocks land in one ``[n, L, 2, H, B, D]`` tensor and are copied
        into the cache's tensors (a byte copy fills whole blocks only). Compressed
        blocks land as bytes and each layer is decoded straight into that layer's own
        keys and values tensor (``decode(layers=...)``): one pass, and no prefix-sized
        tensor, whose fresh pages would cost a fault per 4 KiB on every read.
        """
        n = len(keys)
        if self.codec is None or n == 0:
            got, buf = self.fetch_blocks(store, keys)
            crop = tokens if got == n else None
            return (got, self.cache_from_blocks(buf[:got], tokens=crop)) if got else (0, None)
        land = torch.empty((n, self.stored_block_bytes), dtype=torch.uint8, device=self.device)
        got = get_prefix_into(store, keys, list(land.unbind(0)), self.namespace)
        if got == 0:
            return 0, None
        L, _, H, B, D = self.block_shape
        t = tokens if tokens is not None and got == n else got * B
        if not 0 <= t <= got * B:
            raise ValueError(f"{t} tokens do not fit {got} blocks of {B}")
        data = []
        for li in range(L):  # each layer's keys and values: their own tensor, as the cache's
            kv = torch.empty((2, 1, H, got * B, D), dtype=self.dtype, device=self.device)
            blocks = kv.view(2, H, got, B, D).permute(2, 0, 1, 3, 4).unsqueeze(1)
            try:
                self.codec.decode(land[:got], blocks, layers=(li, li + 1))
            except KVStoreError:  # a verified block with a bad scale: refuse the prefix
                return 0, None
            data.append((kv[0, :, :, :t], kv[1, :, :, :t]))
        return got, self._cache(data)

    def _cache(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """A DynamicCache over ``data``'s tensors themselves. transformers' own way in
        (``ddp_cache_data``) copies each of them (a ``cat`` onto an empty tensor): a
        second copy of the whole prefix, a tenth of a CPU prefill's time to first token.
        Plain full-attention layers adopt the tensors; any other kind of layer (sliding
        windows keep more state) is filled transformers' way."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        layers = getattr(cache, "layers", [])
        if len(layers) != len(data) or any(type(ly) is not DynamicLayer for ly in layers):
            return DynamicCache(ddp_cache_data=data, config=self.model.config)
        for layer, (k, v) in zip(layers, data, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    def load_prefix(
        self, store: BlockStore, keys: Sequence[bytes], n_prompt_tokens: int
    ) -> tuple[int, Any]:
        """Fetch the longest stored, verified prefix; returns (blocks loaded, cache or None).

        Stops at the first block that is missing, corrupt or refused: a prefix is only
        reusable up to its first gap, and a cache may miss but never load wrong KV.
        """
        n = self.reusable_blocks(n_prompt_tokens, matched_blocks(store, keys))
        if n == 0:
            return 0, None
        return self.load_cache(store, keys[:n])

    def put_blocks(
        self, store: BlockStore, keys: Sequence[bytes], blocks: torch.Tensor
    ) -> list[Any]:
        """Put the rows of a staging tensor (``[n, L, 2, H, B, D]``) under ``keys`` as one
        batch: each key's outcome (True new, False already stored, or its error).

        Uncompressed rows go to the store where they are (a CUDA tensor's bytes leave
        the device in the store client's own batched copy). A compressed namespace's
        rows are encoded on the device in one call, then the encoded batch crosses to
        the host in one copy: the store takes a codec's blocks as bytes. Raises
        InvalidValue for a block the codec refuses (inf or nan).
        """
        if self.codec is None:
            values: list[Any] = list(blocks.unbind(0))
        else:
            host = self.codec.encode(blocks).reshape(len(keys), -1).cpu().numpy()
            values = [host[i].data for i in range(len(keys))]
        return put_batch(store, keys, values, self.namespace)

    def store_blocks(self, store: BlockStore, keys: Sequence[bytes], cache: Any, start: int) -> int:
        """Write full blocks ``start..len(keys)-1`` from ``cache`` as one batch; returns
        how many were new. Raises the first key's error, after the batch has run."""
        if start >= len(keys):
            return 0
        res = self.put_blocks(store, keys[start:], self.gather(cache, start, len(keys)))
        for r in res:
            if isinstance(r, Exception):
                raise r
        return sum(1 for r in res if r is True)

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
        one is allocated on ``out``'s device when not given.
        """
        if self.codec is None:
            return store.get_into(key, out, namespace=self.namespace)
        raw = (
            torch.empty(self.stored_block_bytes, dtype=torch.uint8, device=out.device)
            if staging is None
            else staging
        )
        if not store.get_into(key, raw, namespace=self.namespace):
            return False
        self.codec.decode(raw, out)
        return True
