"""The byte format every scaled 1-byte codec shares, without torch.

A compressed block of shape ``[layers, 2, kv_heads, block_tokens, head_dim]`` is stored
as two sections, back to back:

* the scales: one float32 per ``(layer, k|v, head)`` (``layers * 2 * kv_heads`` of them,
  little-endian), so keys and values of every head get their own range;
* the values: one byte per element in the block's own order, each the element divided
  by its head's scale and rounded to the codec's 1-byte type.

The store keeps these bytes opaque; only their size matters to it, which is why this
module knows sizes and nothing else: :mod:`kvstore.layout` sizes a compressed block
from here without importing torch, which the server never needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import ConfigError

__all__ = ["FLOAT_DTYPES", "SCALE_BYTES", "encoded_nbytes", "scale_count"]

SCALE_BYTES = 4
"""Bytes of one scale (float32): exact for any range a bf16/fp16/fp32 tensor holds."""

FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
"""Engine dtypes a codec compresses and decodes back into (canonical names)."""


def _check_shape(shape: Sequence[int]) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
        raise ConfigError(f"a KV block is [layers, 2, kv_heads, tokens, head_dim], got {shape}")
    return (shape[0], shape[1], shape[2], shape[3], shape[4])


def scale_count(shape: Sequence[int]) -> int:
    """Scales in a block of ``shape``: one per (layer, k|v, head)."""
    layers, two, heads, _, _ = _check_shape(shape)
    return layers * two * heads


def encoded_nbytes(shape: Sequence[int]) -> int:
    """Bytes of a compressed block of ``shape``: the scales, then one byte per element."""
    layers, two, heads, tokens, head_dim = _check_shape(shape)
    return scale_count(shape) * SCALE_BYTES + layers * two * heads * tokens * head_dim
