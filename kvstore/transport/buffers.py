"""Where received payload bytes land: the caller's buffer or a freshly allocated value.

Both transports receive into a flat, writable uint8 host view: for ``get_into`` a view
of the caller's tensor/array (after the same dtype and size checks as
``blocks.copy_payload``, so bytes are never reinterpreted as another dtype), for ``get``
a new value of the kind that was stored. A CUDA output is filled through a host staging
buffer copied to the device by ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.blocks import (
    KIND_BYTES,
    KIND_NUMPY,
    KIND_TORCH,
    BlockHeader,
    checksum,
    describe,
    host_bytes,
)
from kvstore.errors import BlockTooLarge, InvalidValue, KVStoreError, LayoutMismatch

__all__ = ["Landing", "Outgoing", "fresh_landing", "out_landing", "prepare_writes"]


class Landing:
    """A flat uint8 view to fill, and ``finish()`` giving the result once it is full."""

    __slots__ = ("finish", "view")

    def __init__(self, view: np.ndarray, finish: Callable[[], Any]) -> None:
        self.view = view
        self.finish = finish


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def out_landing(header: BlockHeader, out: Any) -> Landing:
    """Land a block in the caller's preallocated buffer (``get_into``)."""
    info = describe(out)
    if info.kind != KIND_BYTES and info.dtype != header.dtype:
        raise LayoutMismatch(f"output dtype {info.dtype} != stored {header.dtype}")
    if info.nbytes != header.payload_len:
        raise LayoutMismatch(f"output holds {info.nbytes} bytes, block has {header.payload_len}")
    if isinstance(out, np.ndarray):  # first: the common case, and never a tensor
        if not out.flags.writeable:
            raise InvalidValue("output array is read-only")
        return Landing(out.reshape(-1).view(np.uint8), _true)
    if _is_torch(out):
        import torch

        flat = out.reshape(-1).view(torch.uint8)
        if out.device.type == "cpu":
            return Landing(flat.numpy(), _true)
        staging = np.empty(info.nbytes, dtype=np.uint8)

        def to_device() -> bool:
            flat.copy_(torch.from_numpy(staging))
            return True

        return Landing(staging, to_device)
    mv = memoryview(out)
    if mv.readonly:
        raise InvalidValue("output buffer is read-only (bytes): pass a bytearray")
    return Landing(np.frombuffer(mv.cast("B"), dtype=np.uint8), _true)


def fresh_landing(header: BlockHeader) -> Landing:
    """Land a block in a new value of the stored kind (``get``)."""
    n = header.payload_len
    if header.kind == KIND_TORCH:
        import torch

        t = torch.empty(header.shape, dtype=getattr(torch, header.dtype))
        return Landing(t.reshape(-1).view(torch.uint8).numpy(), lambda: t)
    if header.kind == KIND_NUMPY:
        arr = np.empty(header.shape, dtype=np.dtype(header.dtype))
        return Landing(arr.reshape(-1).view(np.uint8), lambda: arr)
    buf = bytearray(n)
    return Landing(np.frombuffer(buf, dtype=np.uint8), lambda: bytes(buf))


def _true() -> bool:
    return True


class Outgoing:
    """A value ready to send: its key, description, flat bytes and xxh3."""

    __slots__ = ("data", "index", "info", "key", "sum")

    def __init__(self, index: int, key: bytes, value: Any) -> None:
        self.index = index
        self.key = key
        self.info = describe(value)
        self.data = host_bytes(value)
        self.sum = checksum(self.data)


def prepare_writes(
    keys: Sequence[bytes], values: Sequence[Any], results: list[Any], max_value: int
) -> list[Outgoing]:
    """Describe and checksum each value; a value that cannot be stored (bad type, over
    ``max_value`` bytes) gets its error in ``results`` and is left out of the request."""
    out = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        try:
            item = Outgoing(i, k, v)
            if item.info.nbytes > max_value:
                raise BlockTooLarge(
                    f"value of {item.info.nbytes} bytes exceeds the server's "
                    f"max_value_bytes {max_value}"
                )
            out.append(item)
        except KVStoreError as exc:
            results[i] = exc
    return out
