"""The codec seam: a KV block in the engine's dtype <-> opaque compressed bytes.

A codec sits between an engine and the store. It encodes one block
(``[layers, 2, kv_heads, block_tokens, head_dim]`` in bf16, fp16 or fp32) into a flat
uint8 tensor the store keeps as it is (so its checksums cover the compressed bytes,
in every tier and on the wire), and decodes such bytes back into a caller's block of
the engine's dtype. Which codec a namespace uses is part of its layout fingerprint
(:mod:`kvstore.layout`), so bytes of one codec are never decoded by another.

:class:`ScaledCodec` is the shared machinery of the 1-byte codecs (fp8, int8): one
float32 scale per (layer, k|v, head), the format of :mod:`kvstore.codec.format`. A
subclass says only how a scaled float32 becomes its byte and back.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from kvstore.codec.format import FLOAT_DTYPES, SCALE_BYTES, encoded_nbytes
from kvstore.errors import CorruptBlock, InvalidValue, LayoutMismatch

__all__ = ["KVCodec", "ScaledCodec"]


class KVCodec(ABC):
    """Compresses KV blocks for the store and restores them for the engine.

    A block is ``[layers, 2, kv_heads, block_tokens, head_dim]``; both methods also take
    a stack of blocks (any leading dimensions), so a reader decodes a whole prefix in a
    few large operations instead of a few small ones per block.
    """

    name: ClassVar[str]
    """The name the layout and the registry know this codec by (``fp8``, ``int8``)."""

    @abstractmethod
    def encoded_nbytes(self, shape: Sequence[int]) -> int:
        """Bytes :meth:`encode` returns for one block of ``shape`` (fixed per shape:
        the store sizes every block of a namespace from its layout)."""

    @abstractmethod
    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """uint8 ``[encoded_nbytes]`` for a block (``[*lead, encoded_nbytes]`` for a
        stack, one row per block); raises InvalidValue for a block it cannot represent
        (inf or nan, a non-float dtype)."""

    @abstractmethod
    def decode(
        self, data: Any, out: torch.Tensor, *, layers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Dequantize ``data`` (bytes from :meth:`encode`, the blocks back to back) into
        ``out`` (a block or a stack of them, in the engine's dtype); returns ``out``.

        ``layers=(a, b)``: ``data`` holds whole blocks and only their layers a..b-1 are
        decoded, into an ``out`` of ``b - a`` layers (so a reader can fill each layer's
        own tensors, as a KV cache keeps them, without a prefix-sized staging copy)."""


def _geometry(block: torch.Tensor, what: str) -> tuple[int, tuple[int, int, int, int, int]]:
    """(blocks in the stack, one block's shape), refusing what no codec can take."""
    dtype = str(block.dtype).removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:
        raise InvalidValue(
            f"{what} is {dtype}; a KV codec works on {', '.join(sorted(FLOAT_DTYPES))}"
        )
    s = tuple(block.shape)
    if len(s) < 5 or s[-4] != 2 or min(s) <= 0:
        raise InvalidValue(f"{what} is {s}; a KV block is [layers, 2, kv_heads, tokens, dim]")
    count = 1
    for d in s[:-5]:
        count *= d
    return count, (s[-5], s[-4], s[-3], s[-2], s[-1])


def _as_bytes(data: Any) -> torch.Tensor:
    """A flat uint8 tensor over ``data`` (a tensor, numpy array or buffer), 4-byte
    aligned so its scales can be viewed as float32 without a copy when possible."""
    if isinstance(data, torch.Tensor):
        t = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    else:
        mv = memoryview(data).cast("B")
        t = torch.frombuffer(bytearray(mv) if mv.readonly else mv, dtype=torch.uint8)
    if t.storage_offset() % SCALE_BYTES:
        t = t.clone()
    return t


class ScaledCodec(KVCodec):
    """One float32 scale per (layer, k|v, head), one byte per element.

    The scale is the head's largest magnitude over ``qmax``, so every element maps
    into the byte type's range; an all-zero head gets scale 0 and decodes to zeros.
    """

    qmax: ClassVar[float]
    """Largest magnitude of the byte type (the head's absmax maps onto it)."""
    unit: ClassVar[float] = 1.0
    """What one in :meth:`_from_bytes`'s numbers is worth (the multiply by the scale
    takes it in): fp8 decodes to values over 256 (kvstore/codec/fp8.py)."""

    @abstractmethod
    def _to_bytes(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``scaled`` (float32 in [-qmax, qmax], may be modified) into ``out``
        (uint8 of the same shape, one byte per element)."""

    @abstractmethod
    def _from_bytes(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write what the bytes ``values`` (uint8, rows may be strided) encode, in
        :attr:`unit`, into ``out`` (float32 of their shape, contiguous)."""

    def encoded_nbytes(self, shape: Sequence[int]) -> int:
        return encoded_nbytes(shape)

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        count, shape = _geometry(block, "block")
        layers, two, heads, tokens, dim = shape
        rows = layers * two * heads
        flat = block.detach().reshape(count * rows, tokens * dim)
        lo, hi = torch.aminmax(flat, dim=1)  # exact in any float dtype
        amax = torch.maximum(hi, lo.neg()).float()  # nan and inf survive, for the check below
        finite = torch.isfinite(amax)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0, 0])
            i, row = divmod(bad, rows)
            layer, kv, head = row // (two * heads), (row // heads) % two, row % heads
            raise InvalidValue(
                f"KV block {i} has inf or nan at layer {layer}, {'kv'[kv]}, head {head}: "
                f"refusing to {self.name}-encode it (it would decode to garbage)"
            )
        scale = amax / self.qmax
        # qmax * scale may round past float32's max for a head near it: step the scale
        # down one ulp there (its top element then clamps to qmax), so decode stays finite.
        big = ~torch.isfinite(scale * self.qmax)
        scale = torch.where(big, torch.nextafter(scale, torch.zeros_like(scale)), scale)
        # One pass: the division promotes to float32 and is the copy the rounding works on.
        x = flat / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
        per = encoded_nbytes(shape)
        out = torch.empty((count, per), dtype=torch.uint8, device=block.device)
        n = rows * SCALE_BYTES
        out[:, :n].copy_(scale.view(count, rows).view(torch.uint8))
        self._to_bytes(x.view(count, rows * tokens * dim), out[:, n:])
        return out.view(-1) if block.dim() == 5 else out.view(*block.shape[:-5], per)

    def decode(
        self, data: Any, out: torch.Tensor, *, layers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        count, shape = _geometry(out, "output block")
        _, _, _, tokens, dim = shape
        scale, values = self._rows(_as_bytes(data), count, shape, layers)
        if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            raise CorruptBlock(f"{self.name} block has a negative or non-finite scale")
        rows, width = values.shape[1], tokens * dim
        # Each piece is dequantized in float32 and rounded once to the output's dtype: in
        # place in a contiguous float32 output, else in this thread's float32 scratch of
        # one piece, copied into the output while it is still in cache (a prefix-sized
        # float32 buffer cost a page fault per 4 KiB and one more pass through memory:
        # a bf16 prefix decoded 7x slower than a float32 one on one CPU thread). An
        # output whose (layer, k|v, head) rows are evenly strided, such as blocks that
        # are views of a KV cache's [layers, 2, heads, tokens, dim] tensors, is written
        # where it is; any other layout goes through one contiguous copy.
        try:
            ys = out.view(count, rows, width)
            dense = out
        except RuntimeError:
            dense = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            ys = dense.view(count, rows, width)
        direct = dense.dtype == torch.float32 and dense.is_contiguous()
        step = scale.to(out.device).view(count, rows, 1)
        if self.unit != 1.0:
            step = step * self.unit
        pieces = list(_pieces(count, rows, width))
        most = max(ys[b, r].numel() for b, r in pieces)
        scratch = None if direct else self._float_scratch(most, out.device)
        for b, r in pieces:
            dst = ys[b, r]
            piece = dst if scratch is None else scratch[: dst.numel()].view(dst.shape)
            self._from_bytes(values[b, r], piece)
            piece.mul_(step[b, r])
            if scratch is not None:
                dst.copy_(piece)
        if dense is not out:
            out.copy_(dense)
        return out

    def _rows(
        self,
        raw: torch.Tensor,
        count: int,
        shape: tuple[int, int, int, int, int],
        layers: tuple[int, int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 scales ``[count * rows]``, byte views ``[count, rows, width]``) of
        the (layer, k|v, head) rows to decode: every row of ``shape``'s blocks, or the
        rows of ``layers`` [a, b) of whole blocks whose layer count the size says."""
        out_layers, two, heads, tokens, dim = shape
        row_bytes = two * heads * (SCALE_BYTES + tokens * dim)  # one layer, stored
        total = out_layers if layers is None else raw.numel() // max(count * row_bytes, 1)
        a, b = (0, out_layers) if layers is None else layers
        per = encoded_nbytes((max(total, 1), two, heads, tokens, dim))
        if raw.numel() != count * per or not 0 <= a < b <= total or b - a != out_layers:
            got = "" if layers is None else f" (layers {a}..{b - 1})"
            raise LayoutMismatch(
                f"{raw.numel()} bytes to decode into {count} {self.name} block(s) of "
                f"{shape}{got}: not whole blocks of that geometry"
            )
        r0, r1 = a * two * heads, b * two * heads
        n = total * two * heads * SCALE_BYTES  # where the values start
        blocks = raw.view(count, per)
        scale = blocks[:, r0 * SCALE_BYTES : r1 * SCALE_BYTES].reshape(-1)  # copied if strided
        width = tokens * dim
        values = blocks[:, n + r0 * width : n + r1 * width].view(count, r1 - r0, width)
        return scale.view(torch.float32), values

    def _float_scratch(self, n: int, device: torch.device) -> torch.Tensor:
        """This thread's float32 buffer of at least ``n`` elements on ``device`` (grown,
        never shrunk, so a decode does not fault in fresh pages every time)."""
        local = self.__dict__.setdefault("_float_local", threading.local())
        buf: torch.Tensor | None = getattr(local, "buf", None)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = torch.empty(n, dtype=torch.float32, device=device)
            local.buf = buf
        return buf


DECODE_PIECE = 1 << 20
"""Elements decoded at a time: the piece's float32 output (4 MiB) and a codec's scratch
stay in cache between the conversion and the multiply by the scale, where whole-prefix
passes went to memory and back for each (fp8 decoded 2.3x faster in pieces, on CPU)."""


def _pieces(count: int, rows: int, width: int) -> Iterator[tuple[slice, slice]]:
    """(blocks, rows) slices of about DECODE_PIECE elements, in order, each contiguous
    in a contiguous ``[count, rows, width]`` tensor."""
    per_block = rows * width
    if per_block >= DECODE_PIECE:
        step = max(1, DECODE_PIECE // width)
        for i in range(count):
            for r in range(0, rows, step):
                yield slice(i, i + 1), slice(r, min(rows, r + step))
        return
    k = DECODE_PIECE // per_block
    for i in range(0, count, k):
        yield slice(i, min(count, i + k)), slice(0, rows)
