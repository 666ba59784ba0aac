"""The KV layout fingerprint: what must agree for two workers to share KV blocks.

A layout string names the dtype and geometry of one block, e.g. ``bf16:L32:H8:D128``
(dtype, layers, KV heads, head dim) with optional ``B16`` (tokens per block) and
``R0`` (tensor-parallel rank). It is part of the namespace, so a model, dtype or
sharding change yields different keys and can never load foreign KV.

An optional ``C<codec>`` (``Cfp8``, ``Cint8``; see :mod:`kvstore.codec`) says the
stored bytes are that codec's compression of blocks of this dtype and geometry. It
joins the canonical string only when present, so an uncompressed layout hashes
exactly as it always has, and a compressed one can never share keys (or a
fingerprint) with it. A compressed layout needs ``B<n>``: its payload size is fixed
per block, not per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvstore.codec.format import FLOAT_DTYPES
from kvstore.codec.registry import codec_spec, normalize_codec
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
_CODEC = re.compile(r"^[Cc]([A-Za-z][A-Za-z0-9_]*)$")


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
    codec: str | None = None
    """Compression of the stored bytes (``fp8``, ``int8``), None when stored as is."""

    @classmethod
    def parse(cls, text: str) -> KVLayout:
        """Parse ``dtype:L<n>:H<n>:D<n>[:B<n>][:R<n>][:C<codec>]`` (fields after dtype
        in any order)."""
        parts = [p for p in str(text).split(":") if p]
        if len(parts) < 4:
            raise ConfigError(f"layout {text!r} must look like 'bf16:L32:H8:D128[:B16][:R0]'")
        fields: dict[str, int] = {}
        codec: str | None = None
        for p in parts[1:]:
            c = _CODEC.match(p)
            if c:
                if codec is not None:
                    raise ConfigError(f"layout {text!r}: field C given twice")
                codec = cls._codec_of(text, c.group(1))
                continue
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
            codec=codec,
        )
        if min(layout.layers, layout.kv_heads, layout.head_dim) <= 0:
            raise ConfigError(f"layout {text!r}: L, H and D must be positive")
        if layout.block_tokens is not None and layout.block_tokens <= 0:
            raise ConfigError(f"layout {text!r}: B must be positive")
        layout._check_codec(text)
        return layout

    @staticmethod
    def _codec_of(text: str, name: str) -> str:
        """The canonical codec name of a ``C<name>`` field (``none`` is refused: an
        uncompressed layout simply has no C field, so it has one spelling)."""
        codec = normalize_codec(name)
        if codec is None:
            raise ConfigError(f"layout {text!r}: leave C out for an uncompressed layout")
        return codec

    def _check_codec(self, text: str) -> None:
        if self.codec is None:
            return
        if self.block_tokens is None:
            raise ConfigError(f"layout {text!r}: a compressed layout needs B<n>")
        if self.dtype not in FLOAT_DTYPES:
            raise ConfigError(
                f"layout {text!r}: codec {self.codec} compresses "
                f"{', '.join(sorted(FLOAT_DTYPES))}, not {self.dtype}"
            )

    def with_codec(self, codec: str | None) -> KVLayout:
        """The same layout with its stored bytes compressed by ``codec`` (None: raw)."""
        layout = replace(self, codec=normalize_codec(codec))
        layout._check_codec(self.canonical())
        return layout

    def with_block_tokens(self, block_tokens: int) -> KVLayout:
        """The same layout with the block size filled in (or checked against it)."""
        if self.block_tokens is not None and self.block_tokens != block_tokens:
            raise ConfigError(
                f"layout says B{self.block_tokens} but block_tokens={block_tokens} was asked"
            )
        return replace(self, block_tokens=block_tokens)

    def canonical(self) -> str:
        """The one spelling of this layout that goes into hashes (``:C<codec>`` last,
        and only when compressed: uncompressed layouts keep their old spelling)."""
        s = f"{self.dtype}:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"
        if self.block_tokens is not None:
            s += f":B{self.block_tokens}"
        s += f":R{self.rank}"
        return s if self.codec is None else s + f":C{self.codec}"

    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, kv_heads, block_tokens, head_dim)``; needs ``block_tokens``."""
        if self.block_tokens is None:
            raise ConfigError("layout has no block size (add :B<n>)")
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    def block_bytes(self) -> int:
        """Payload bytes of one stored block: the codec's compressed size when the
        layout has one (what the store checks a put against), else dtype x shape."""
        if self.codec is not None:
            return codec_spec(self.codec).encoded_nbytes(self.block_shape())
        return self.raw_block_bytes()

    def raw_block_bytes(self) -> int:
        """Bytes of one block in the layout's dtype, before any compression."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.block_shape():
            n *= d
        return n
