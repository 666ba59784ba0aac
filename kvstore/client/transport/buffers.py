"""Where received payload bytes land: the caller's buffer or a freshly allocated value.

Both transports receive into a flat, writable uint8 host view: for ``get_into`` a view
of the caller's tensor/array (after the same dtype and size checks as
``blocks.copy_payload``, so bytes are never reinterpreted as another dtype), for ``get``
a new value of the kind that was stored. A CUDA output is filled through a host staging
buffer copied to the device by ``finish``.

Fresh values of a quarter MiB or more are built on recycled memory (:class:`LandingPool`):
on this kind of host a first touch costs more per byte than the transfer itself, and
glibc gives a freed multi-MiB heap top back to the OS, so without it every ``batch_get``
of a few MiB would fault its whole result in again.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
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

__all__ = [
    "LANDING_POOL",
    "Landing",
    "LandingPool",
    "Outgoing",
    "check_out",
    "copy_hashed",
    "fresh_landing",
    "out_landing",
    "prepare_writes",
]


class Landing:
    """A flat uint8 view to fill, and ``finish()`` giving the result once it is full."""

    __slots__ = ("finish", "view")

    def __init__(self, view: np.ndarray, finish: Callable[[], Any]) -> None:
        self.view = view
        self.finish = finish


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def check_out(header: BlockHeader, out: Any, nbytes: int | None = None) -> None:
    """Refuse an output of another dtype or size than the block (or ``nbytes`` of it: a
    layer range), so bytes are never reinterpreted as another dtype."""
    info = describe(out)
    if info.kind != KIND_BYTES and info.dtype != header.dtype:
        raise LayoutMismatch(f"output dtype {info.dtype} != stored {header.dtype}")
    want = header.payload_len if nbytes is None else nbytes
    if info.nbytes != want:
        what = "the layer range has" if nbytes is not None else "block has"
        raise LayoutMismatch(f"output holds {info.nbytes} bytes, {what} {want}")


def out_landing(header: BlockHeader, out: Any, nbytes: int | None = None) -> Landing:
    """Land a block (or ``nbytes`` of it: a layer range) in the caller's preallocated
    buffer (``get_into``). A CUDA output here (a batch the device paths of
    kvstore/client/device/ do not take whole) is staged through host memory."""
    check_out(header, out, nbytes)
    if isinstance(out, np.ndarray):  # first: the common case, and never a tensor
        if not out.flags.writeable:
            raise InvalidValue("output array is read-only")
        return Landing(out.reshape(-1).view(np.uint8), _true)
    if _is_torch(out):
        import torch

        flat = out.reshape(-1).view(torch.uint8)
        if out.device.type == "cpu":
            return Landing(flat.numpy(), _true)
        staging = np.empty(flat.numel(), dtype=np.uint8)

        def to_device() -> bool:
            flat.copy_(torch.from_numpy(staging))
            return True

        return Landing(staging, to_device)
    mv = memoryview(out)
    if mv.readonly:
        raise InvalidValue("output buffer is read-only (bytes): pass a bytearray")
    return Landing(np.frombuffer(mv.cast("B"), dtype=np.uint8), _true)


class LandingPool:
    """Recycled, already faulted-in host memory for the fresh values of ``get``.

    A value of ``min_bytes`` or more lives in a region (an anonymous mapping, rounded up
    to whole pages) exported through a ctypes array made for that value alone. Every
    view of the value holds that array (numpy views through their ``base`` chain,
    memoryviews and torch tensors through the buffer they were made from), so a weakref
    on it fires only once nothing can reach the memory any more; the region then goes
    back to its size's free list and a later value reuses it without a page fault. At
    most ``idle_bytes`` wait there: past that, regions of other sizes go first, then the
    returning one is unmapped.

    Thread-safe. ``_lock`` (reentrant: a weakref callback run by the garbage collector
    inside a locked section returns a region on the same thread) guards ``_free``,
    ``_idle`` and ``_live``.
    """

    def __init__(self, min_bytes: int = 256 << 10, idle_bytes: int = 64 << 20) -> None:
        self.min_bytes = min_bytes
        self.idle_bytes = idle_bytes
        self._lock = threading.RLock()
        self._free: dict[int, list[mmap.mmap]] = {}  # page-rounded size -> idle regions
        self._idle = 0
        # id(weakref) -> (the weakref, kept alive here; size; region) of each lent region
        self._live: dict[int, tuple[weakref.ref[Any], int, mmap.mmap]] = {}

    @property
    def idle(self) -> int:
        """Bytes of regions waiting for reuse."""
        return self._idle

    def buffer(self, n: int) -> Any:
        """A writable buffer of exactly ``n`` bytes whose memory comes back to the pool
        when it (and everything made from it) is gone."""
        size = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        region = None
        with self._lock:
            free = self._free.get(size)
            if free:
                region = free.pop()
                self._idle -= size
        if region is None:
            region = mmap.mmap(-1, size)
        exporter = (ctypes.c_ubyte * n).from_buffer(region)
        ref = weakref.ref(exporter, self._returned)
        with self._lock:
            self._live[id(ref)] = (ref, size, region)
        return exporter

    def _returned(self, ref: weakref.ref[Any]) -> None:
        with self._lock:
            _, size, region = self._live.pop(id(ref))
            if self._idle + size > self.idle_bytes:
                for other, free in self._free.items():
                    while free and other != size and self._idle + size > self.idle_bytes:
                        free.pop(0)
                        self._idle -= other
                if self._idle + size > self.idle_bytes:
                    return  # unmapped once the last reference goes
            self._free.setdefault(size, []).append(region)
            self._idle += size

    def _after_fork(self) -> None:
        self._lock = threading.RLock()  # a child must not inherit a lock held mid-call


LANDING_POOL = LandingPool()
os.register_at_fork(after_in_child=LANDING_POOL._after_fork)


def fresh_landing(header: BlockHeader) -> Landing:
    """Land a block in a new value of the stored kind (``get``)."""
    n = header.payload_len
    pooled = n >= LANDING_POOL.min_bytes
    if header.kind == KIND_TORCH:
        import torch

        dtype = getattr(torch, header.dtype)
        if pooled:
            raw = torch.frombuffer(LANDING_POOL.buffer(n), dtype=torch.uint8)
            t = raw.view(dtype).reshape(header.shape)
        else:
            t = torch.empty(header.shape, dtype=dtype)
        return Landing(t.reshape(-1).view(torch.uint8).numpy(), lambda: t)
    if header.kind == KIND_NUMPY:
        dt = np.dtype(header.dtype)
        if pooled:
            flat = np.frombuffer(LANDING_POOL.buffer(n), dtype=np.uint8)
            arr = flat.view(dt).reshape(header.shape)
            return Landing(flat, lambda: arr)
        arr = np.empty(header.shape, dtype=dt)
        return Landing(arr.reshape(-1).view(np.uint8), lambda: arr)
    if pooled:  # bytes are immutable: land in a pooled buffer, then one copy out
        view = np.frombuffer(LANDING_POOL.buffer(n), dtype=np.uint8)
        return Landing(view, view.tobytes)
    buf = bytearray(n)
    return Landing(np.frombuffer(buf, dtype=np.uint8), lambda: bytes(buf))


def _true() -> bool:
    return True


class Outgoing:
    """A value ready to send: its key, description, flat bytes and xxh3. A value the
    transport's device side takes (``on_device``) keeps its tensor in ``device`` and has
    no host bytes yet: the device path copies it out (kvstore/client/device/writes.py)."""

    __slots__ = ("data", "device", "index", "info", "key", "sum")

    def __init__(
        self,
        index: int,
        key: bytes,
        value: Any,
        *,
        hashed: bool = True,
        on_device: Callable[[Any], bool] | None = None,
    ) -> None:
        self.index = index
        self.key = key
        self.info = describe(value)
        self.device: Any = None
        self.data: Any = None
        self.sum = 0
        if on_device is not None and on_device(value):
            self.device = value
            return
        self.data = host_bytes(value)
        if hashed:
            self.sum = checksum(self.data)


def prepare_writes(
    keys: Sequence[bytes],
    values: Sequence[Any],
    results: list[Any],
    max_value: int,
    *,
    hashed: bool = True,
    on_device: Callable[[Any], bool] | None = None,
) -> list[Outgoing]:
    """Describe and (with ``hashed``) checksum each value; a value that cannot be stored
    (bad type, over ``max_value`` bytes) gets its error in ``results`` and is left out
    of the request. Without ``hashed`` the caller hashes as it copies (copy_hashed);
    values ``on_device`` takes keep their tensor (Outgoing.device), unhashed."""
    out = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        try:
            item = Outgoing(i, k, v, hashed=hashed, on_device=on_device)
            if item.info.nbytes > max_value:
                raise BlockTooLarge(
                    f"value of {item.info.nbytes} bytes exceeds the server's "
                    f"max_value_bytes {max_value}"
                )
            out.append(item)
        except KVStoreError as exc:
            results[i] = exc
    return out


def copy_hashed(dst: np.ndarray, src: Any) -> int:
    """Copy ``src`` (flat bytes) into ``dst`` and return the xxh3 of the *source*.

    Hashed after the copy, while the source is still in cache: 1 MiB copied then hashed
    costs ~100 us here against ~135 us copied and hashed in 256 KiB slices (smaller
    copies lose the large-copy path of memcpy). The source is what is hashed: if the
    caller changes its buffer during the copy, the server's check of the landed bytes
    fails and nothing torn is stored."""
    s = np.frombuffer(src, dtype=np.uint8)
    np.copyto(dst, s)
    return checksum(s)
