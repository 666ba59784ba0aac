"""fp8 (e4m3): each scaled element rounded to float8_e4m3fn.

e4m3 keeps 3 mantissa bits at every magnitude, so small and large elements of a head
get the same relative error (about 1/16); its largest finite value, 448, is where the
head's absmax lands.

Decoding on CPU looks each byte up in a 256-entry float32 table (numpy ``take``):
torch's float8 -> float32 conversion is scalar code on CPU, several times slower.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.codec.base import ScaledCodec

__all__ = ["FP8Codec"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Every byte's float32 value (the two NaN codes are never written: encode clamps).
_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


class FP8Codec(ScaledCodec):
    """Per-(layer, k|v, head) scaled float8_e4m3fn."""

    name = "fp8"
    qmax = FP8_MAX

    def _to_bytes(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        # The clamp guards the last ulp of the division: e4m3fn has no inf to saturate to.
        scaled.clamp_(-FP8_MAX, FP8_MAX)
        out.view(torch.float8_e4m3fn).copy_(scaled)

    def _from_bytes(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if values.device.type == "cpu":
            # Straight into ``out``: a new array of a prefix's size costs a fresh mapping
            # per read, whose page faults cost more than the lookups at times. mode="clip"
            # because numpy buffers a take into ``out`` in its default mode.
            np.take(_TABLE, values.numpy(), out=out.numpy(), mode="clip")
            return out
        return out.copy_(values.view(torch.float8_e4m3fn))
