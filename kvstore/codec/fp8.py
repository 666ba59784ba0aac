"""fp8 (e4m3): each scaled element rounded to float8_e4m3fn.

e4m3 keeps 3 mantissa bits at every magnitude, so small and large elements of a head
get the same relative error (about 1/16); its largest finite value, 448, is where the
head's absmax lands.

Decoding rewrites each byte as the float16 with the same value over 256, with two
integer passes, converts that to float32 in the output (a vectorized cast), and the
multiply by the head's scale takes the 256 in with it, a piece at a time
(kvstore/codec/base.py). Why it is exact: an e4m3 byte ``s eeee mmm`` shifted left
by 7 bits is the float16 ``s 0eeee mmm0000000``, whose exponent bias (15) is 8 more
than e4m3's (7), and float16 subnormals line up with e4m3's, so every value is exact,
zero and the subnormals included. Every step is a vectorized torch kernel on any
device: on CPU this decodes at 0.8-0.9x of a copy where a 256-entry table lookup
(numpy ``take`` is scalar) ran at 0.11x and torch's own float8 conversion (scalar on
CPU) slower still; on a GPU it runs there like any other elementwise op. Encoding
clamps to +-448, so the two NaN codes are never written.
"""

from __future__ import annotations

import threading

import torch

from kvstore.codec.base import ScaledCodec

__all__ = ["FP8Codec"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_UNIT = 256.0  # the float16 a byte becomes holds its value / 2**(15 - 7)
_CLEAR_BIT_14 = -16385  # int16 0xBFFF: the sign-extension's copy of the sign bit goes
_SHIFT = 128  # x << 7, as an int16 multiply (the shift into place)


class FP8Codec(ScaledCodec):
    """Per-(layer, k|v, head) scaled float8_e4m3fn."""

    name = "fp8"
    qmax = FP8_MAX
    unit = _UNIT

    def __init__(self) -> None:
        self._scratch = threading.local()  # one int16 buffer per thread, reused

    def _to_bytes(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        # The clamp guards the last ulp of the division: e4m3fn has no inf to saturate to.
        scaled.clamp_(-FP8_MAX, FP8_MAX)
        out.view(torch.float8_e4m3fn).copy_(scaled)

    def _from_bytes(self, values: torch.Tensor, out: torch.Tensor) -> None:
        half = self._buffer(values)
        # int8 -> int16 sign-extends: a negative byte 1xxxxxxx becomes 0xFF80 | low7, and
        # times 128 (the shift) 0xC000 | low7 << 7; clearing bit 14 leaves the float16's
        # sign in bit 15 and the byte's exponent and mantissa in bits 13..7. (One kernel
        # per step: a mixed-dtype multiply doing the first two at once ran 5x slower.)
        half.copy_(values.view(torch.int8))
        half.mul_(_SHIFT).bitwise_and_(_CLEAR_BIT_14)
        out.copy_(half.view(torch.float16))

    def _buffer(self, values: torch.Tensor) -> torch.Tensor:
        """This thread's int16 scratch of ``values``' shape (grown, never shrunk: a fresh
        buffer of a prefix's size would cost a page fault per 4 KiB on every read)."""
        n = values.numel()
        buf: torch.Tensor | None = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < n or buf.device != values.device:
            buf = torch.empty(n, dtype=torch.int16, device=values.device)
            self._scratch.buf = buf
        return buf[:n].view(values.shape)
