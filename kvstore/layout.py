"""The KV layout fingerprint: what must agree for two workers to share KV blocks.

A layout string names the dtype and geometry of one block, e.g. ``bf16:L32:H8:D128``
(dtype, layers, KV heads, head dim) with optional ``B16`` (tokens per block) and
``R0`` (tensor-parallel rank). It is part of the namespace, so a model, dtype or
sharding change yields different keys and can never load foreign KV.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["DTYPE_SIZES", "KVLayout", "normalize_dtype"]

# Canonical dtype names and their item sizes. The names are torch's, minus "torch.".
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

_FIELD = re.compile(r"^([LHDBR])(\d+)$")


def normalize_dtype(name: str) -> str:
    """Map ``bf16``, ``torch.bfloat16`` or ``bfloat16`` to the canonical name."""
    n = str(name).removeprefix("torch.").lower()
    n = _ALIASES.get(n, n)
    if n not in DTYPE_SIZES:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_SIZES))}")
    return n


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one stored block: ``[layers, 2, kv_heads, block_tokens, head_dim]``."""

    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int | None = None
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> KVLayout:
        """Parse ``dtype:L<n>:H<n>:D<n>[:B<n>][:R<n>]`` (fields after dtype in any order)."""
        parts = [p for p in str(text).split(":") if p]
        if len(parts) < 4:
            raise ConfigError(f"layout {text!r} must look like 'bf16:L32:H8:D128[:B16][:R0]'")
        fields: dict[str, int] = {}
        for p in parts[1:]:
            m = _FIELD.match(p.upper())
            if not m:
                raise ConfigError(f"layout {text!r}: bad field {p!r}")
            if m.group(1) in fields:
                raise ConfigError(f"layout {text!r}: field {m.group(1)} given twice")
            fields[m.group(1)] = int(m.group(2))
        for need in "LHD":
            if need not in fields:
                raise ConfigError(f"layout {text!r}: missing {need}<n>")
        layout = cls(
            dtype=normalize_dtype(parts[0]),
            layers=fields["L"],
            kv_heads=fields["H"],
            head_dim=fields["D"],
            block_tokens=fields.get("B"),
            rank=fields.get("R", 0),
        )
        if min(layout.layers, layout.kv_heads, layout.head_dim) <= 0:
            raise ConfigError(f"layout {text!r}: L, H and D must be positive")
        if layout.block_tokens is not None and layout.block_tokens <= 0:
            raise ConfigError(f"layout {text!r}: B must be positive")
        return layout

    def with_block_tokens(self, block_tokens: int) -> KVLayout:
        """The same layout with the block size filled in (or checked against it)."""
        if self.block_tokens is not None and self.block_tokens != block_tokens:
            raise ConfigError(
                f"layout says B{self.block_tokens} but block_tokens={block_tokens} was asked"
            )
        return KVLayout(
            self.dtype, self.layers, self.kv_heads, self.head_dim, block_tokens, self.rank
        )

    def canonical(self) -> str:
        """The one spelling of this layout that goes into hashes."""
        s = f"{self.dtype}:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"
        if self.block_tokens is not None:
            s += f":B{self.block_tokens}"
        return s + f":R{self.rank}"

    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, kv_heads, block_tokens, head_dim)``; needs ``block_tokens``."""
        if self.block_tokens is None:
            raise ConfigError("layout has no block size (add :B<n>)")
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    def block_bytes(self) -> int:
        """Payload bytes of one block."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.block_shape():
            n *= d
        return n
