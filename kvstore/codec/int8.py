"""int8: each scaled element rounded to the nearest integer in [-127, 127].

A uniform grid per head: the absolute error is at most half a step (absmax / 254)
everywhere, which suits KV whose heads have no outliers far beyond their bulk. The
grid is symmetric (-128 unused) so zero stays exactly zero.
"""

from __future__ import annotations

import torch

from kvstore.codec.base import ScaledCodec

__all__ = ["Int8Codec"]

INT8_MAX = 127.0


class Int8Codec(ScaledCodec):
    """Per-(layer, k|v, head) scaled symmetric int8."""

    name = "int8"
    qmax = INT8_MAX

    def _to_bytes(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        scaled.round_().clamp_(-INT8_MAX, INT8_MAX)
        out.view(torch.int8).copy_(scaled)

    def _from_bytes(self, values: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(values.view(torch.int8))
