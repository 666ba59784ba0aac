"""KV compression in the vLLM connector: canonical blocks <-> a codec's bytes, on the
device of vLLM's KV tensors.

With ``kv_codec`` (``int8`` or ``fp8``, :mod:`kvstore.codec`) this sits between the
connector's page copies (engine/vllm/paged.py) and the store. A save gathers a chunk of
blocks out of the pages into canonical ``[n, L, 2, H, B, D]`` blocks and encodes them
in one call where they are; only the encoded bytes (a quarter of fp32's, half of bf16's)
go to the host and the store. A load lands the stored bytes in a reused buffer on the
same device, decodes them in one call into the canonical blocks the scatter reads, and
the scatter writes the pages. So a GPU engine compresses on the GPU, and the bytes on
the wire and in every tier are the codec's, covered by the store's checksums.

No step runs anywhere else: :class:`BlockCodec` round-trips a probe block on the KV
tensors' device when the worker binds them, so a codec with no path there (a device
without the dtypes or ops it needs) stops the engine at start with the reason, rather
than failing every request, or quietly running on the host.

A block the codec refuses (inf or nan in vLLM's pages) is not saved: its bytes would
decode to garbage for every reader. Stored bytes that pass the checksum but are no
codec's block (a negative or non-finite scale) fail that block's load like a miss, so
vLLM recomputes it; the key is then offered for removal, as for a corrupt block.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.codec import get_codec
from kvstore.errors import ConfigError, InvalidValue, KVStoreError
from kvstore.layout import KVLayout

__all__ = ["PROBE_TOLERANCE", "BlockCodec"]

log = logging.getLogger("vllm.kvstore")

PROBE_TOLERANCE = 1 / 8
"""Largest error of the start-up round trip, as a share of the probe block's largest
magnitude. Both codecs stay far inside it (int8: 1/254 of a head's range, fp8: 1/16
of an element); a device whose ops run but compute something else does not."""


class BlockCodec:
    """One codec bound to vLLM's KV device and block geometry (one per worker).

    Not thread-safe: a step's loads and saves use it one at a time (whole-block loads
    end before the forward, whole-block saves run after it).
    """

    def __init__(
        self, name: str, layout: KVLayout, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.codec = get_codec(name)  # ConfigError for an unknown name
        self.name = self.codec.name
        self.device = torch.device(device)
        self.block_shape = layout.block_shape()
        self.stored_nbytes = self.codec.encoded_nbytes(self.block_shape)
        self._landing = torch.empty((0, self.stored_nbytes), dtype=torch.uint8)
        self._probe(dtype)

    def _probe(self, dtype: torch.dtype) -> None:
        """Encode and decode one random block on the device; ConfigError unless it runs
        there and comes back within :data:`PROBE_TOLERANCE`."""
        gen = torch.Generator().manual_seed(0)
        where = f"{self.device} ({str(dtype).removeprefix('torch.')})"
        try:
            x = torch.randn(self.block_shape, generator=gen).to(dtype=dtype, device=self.device)
            data = self.codec.encode(x)
            back = self.codec.decode(data, torch.empty_like(x))
            err = float((back.float() - x.float()).abs().max())
            bound = PROBE_TOLERANCE * float(x.float().abs().max())
        except Exception as exc:  # whatever the device lacks, the engine must not start
            raise ConfigError(
                f"kv_codec {self.name!r} cannot run on the KV tensors' device {where}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if data.device != self.device or not err <= bound:
            raise ConfigError(
                f"kv_codec {self.name!r} does not round-trip on {where}: a probe block came "
                f"back off by {err:.3g} (at most {bound:.3g} allowed), on {data.device}"
            )

    def reserve(self, n: int) -> None:
        """Allocate and touch the landing buffer for ``n`` blocks now (at engine start)."""
        self.landing(n)

    def landing(self, n: int) -> torch.Tensor:
        """A reused buffer on the device for ``n`` stored blocks, ``[n, stored_nbytes]``."""
        if self._landing.shape[0] < n:
            # zeros (unlike empty) writes every page: first touch happens here, once.
            shape = (n, self.stored_nbytes)
            self._landing = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        return self._landing[:n]

    def encode(self, blocks: torch.Tensor) -> list[Any]:
        """Each of ``blocks`` (``[n, L, 2, H, B, D]``, on the device) as its stored bytes on
        the host, for one batch put; None for a block the codec refuses (inf or nan)."""
        try:
            return _rows(self.codec.encode(blocks))
        except InvalidValue as exc:
            good = torch.isfinite(blocks.flatten(1)).all(1).tolist()
            log.warning("kvstore: not saving %d block(s): %s", good.count(False), exc)
        if not any(good):
            return [None] * len(good)
        rows = iter(_rows(self.codec.encode(blocks[torch.tensor(good).to(blocks.device)])))
        return [next(rows) if ok else None for ok in good]

    def decode(self, data: torch.Tensor, out: torch.Tensor) -> list[bool]:
        """Decode ``data`` (``[n, stored_nbytes]`` on the device) into ``out``
        (``[n, L, 2, H, B, D]``): per block, whether it decoded (False: its bytes are
        not a block of this codec, and ``out``'s row is not KV)."""
        try:
            self.codec.decode(data, out)
            return [True] * out.shape[0]
        except KVStoreError:  # checked before any write: find the bad block(s)
            pass
        ok = []
        for i in range(out.shape[0]):
            try:
                self.codec.decode(data[i], out[i])
                ok.append(True)
            except KVStoreError:
                ok.append(False)
        return ok


def _rows(encoded: torch.Tensor) -> list[Any]:
    """The rows of an encoded batch as host buffers (one copy off a GPU, none on CPU):
    the store takes a codec's blocks as bytes, whose size its layout checks."""
    host = encoded.reshape(encoded.shape[0], -1).cpu().numpy()
    return [host[i].data for i in range(host.shape[0])]
