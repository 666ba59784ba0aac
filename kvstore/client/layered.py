"""Layer-by-layer writes: store a batch of KV blocks one layer range at a time.

A prefill engine computes a block's KV layer by layer, so a save that waits for the
last layer starts its transfer only after the forward pass. :class:`LayeredPut`
sends each layer range as soon as the caller has it, while later layers are still
computed, and commits every block once at the end::

    shape = (layers, 2, heads, tokens, dim)
    with client.begin_layers(keys, shape=shape, dtype=torch.bfloat16) as w:
        for layer in range(layers):
            w.write(layer, per_block_kv(layer))  # one (1, 2, heads, tokens, dim) per key
        results = w.commit()

The contract (README, "Layer-by-layer writes"):

- The stored block is the one a whole put of the same bytes stores: one object, its
  xxh3 over every layer, computed here as the layers pass and checked by the node at the
  commit. Nothing is visible before :meth:`LayeredPut.commit`; a reader never sees a
  block with a layer missing.
- Layers come in order, each range starting where the previous ended, and every layer
  must be written before the commit (the checksum is a stream over them).
- ``commit(keep=...)`` withdraws items: an engine that learns mid-forward that a
  request's KV is wrong (its load failed) drops those blocks and stores the rest.
- :meth:`LayeredPut.abort`, or leaving the ``with`` block without a commit, stores
  nothing and frees every reservation. So does a writer that dies: the server's stream
  ends early and it aborts.
- The write holds one connection from start to commit. Each layer must reach the server
  within ``put_grace_s`` plus its size at ``put_floor_bytes`` a second of the previous
  (the server's stalled-put rule), and a same-host write's reservation lives at most
  ``lease_ttl_s``. There is no retry: the bytes already sent are not kept.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, Self

import numpy as np

from kvstore.blocks import KIND_NUMPY, KIND_TORCH, ValueInfo, checksum_stream, describe, host_bytes
from kvstore.client.transport.base import LayerSink, Link, Links
from kvstore.errors import InvalidValue, KVStoreError, ReservationError
from kvstore.layout import DTYPE_SIZES

__all__ = ["AsyncLayeredPut", "LayerWrite", "LayeredPut", "LinkLayeredPut", "block_info"]


def block_info(shape: Sequence[int], dtype: Any) -> ValueInfo:
    """The ValueInfo of a block of ``shape`` and ``dtype`` (a torch dtype stores a
    tensor, read back as one; a numpy dtype or a name stores an array)."""
    text = str(dtype)
    kind = KIND_TORCH if text.startswith("torch.") else KIND_NUMPY
    name = text.removeprefix("torch.")
    if kind == KIND_NUMPY and not isinstance(dtype, str):
        try:
            name = np.dtype(dtype).name  # np.uint8, np.dtype("float16"), ...
        except TypeError:
            raise InvalidValue(f"unsupported dtype {dtype!r}") from None
    if name not in DTYPE_SIZES:
        raise InvalidValue(f"unsupported dtype {dtype!r}")
    dims = tuple(int(d) for d in shape)
    if not dims or any(d <= 0 for d in dims):
        raise InvalidValue(f"a block's shape needs positive dimensions, got {dims}")
    n = DTYPE_SIZES[name]
    for d in dims:
        n *= d
    return ValueInfo(name, dims, kind, n)


class LayerWrite(Protocol):
    """What a layer-by-layer write offers: :class:`LayeredPut` on one node, or a cluster
    client's write split over several (kvstore/client/parted_layers.py)."""

    keys: list[bytes]
    on_commit: Callable[[Sequence[Any]], None] | None

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    @property
    def written(self) -> int: ...

    @property
    def done(self) -> bool: ...

    def write(self, layer: int, values: Sequence[Any]) -> None: ...

    def write_stacked(self, layer: int, stacked: Any) -> None: ...

    def commit(self, keep: Sequence[bool] | None = None) -> list[bool | KVStoreError | None]: ...

    def abort(self) -> None: ...


class LayeredPut(ABC):
    """One layer-by-layer write of a batch of blocks of one shape: what
    ``begin_layers`` returns. This base holds what every such write checks (layers in
    order, values of the block's dtype and shape, every layer before the commit); a
    subclass moves the bytes: :class:`LinkLayeredPut` over one link of one node,
    kvstore/client/parted_layers.py over one per part (shard or node) of a split write. Not
    thread-safe: one writer thread at a time.
    """

    def __init__(self, keys: Sequence[bytes], info: ValueInfo, timeout_s: float) -> None:
        self.keys = list(keys)
        self.info = info
        self.layers = info.shape[0]
        self.per_layer = info.nbytes // self.layers
        self._timeout = timeout_s
        self._next = 0  # the first layer not yet written
        # called with the commit's results (a cluster client remembers where keys went)
        self.on_commit: Callable[[Sequence[Any]], None] | None = None
        self._done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    @property
    def written(self) -> int:
        """Layers written so far."""
        return self._next

    @property
    def done(self) -> bool:
        """Committed or aborted: nothing more can be written."""
        return self._done

    def write(self, layer: int, values: Sequence[Any]) -> None:
        """Layers ``[layer, layer + k)`` of every block, in key order: each value a
        contiguous tensor or array of the block's dtype holding ``k`` layers (the
        block's shape with its first dimension ``k``); ``k`` is the same for all."""
        self._check_next(layer)
        if len(values) != len(self.keys):
            raise InvalidValue(f"{len(values)} values for {len(self.keys)} keys")
        parts, k = [], 0
        for v in values:
            got = describe(v)
            if got.dtype != self.info.dtype or got.shape[1:] != self.info.shape[1:]:
                raise InvalidValue(
                    f"a layer range of {got.dtype}{list(got.shape)} for blocks of "
                    f"{self.info.dtype}{list(self.info.shape)}"
                )
            k = k or got.shape[0]
            if got.shape[0] != k or layer + k > self.layers:
                raise InvalidValue(f"layers [{layer}, {layer + got.shape[0]}) of {self.layers}")
            parts.append(host_bytes(v))
        per = self.per_layer
        self._send(layer, k, lambda j: [p[j * per : (j + 1) * per] for p in parts])

    def write_stacked(self, layer: int, stacked: Any) -> None:
        """Layers ``[layer, layer + k)`` of every block as one contiguous tensor or
        array shaped ``(k, len(keys), *shape[1:])``: layer-major, the wire's own order,
        so it leaves as it lies, with no per-block Python work beyond the checksum (an
        engine gathering each layer of a step's blocks into one buffer)."""
        self._check_next(layer)
        got = describe(stacked)
        n = len(self.keys)
        if got.dtype != self.info.dtype or got.shape[1:] != (n, *self.info.shape[1:]):
            raise InvalidValue(
                f"stacked layers of {got.dtype}{list(got.shape)} for {n} blocks of "
                f"{self.info.dtype}{list(self.info.shape)}"
            )
        k = got.shape[0]
        if layer + k > self.layers:
            raise InvalidValue(f"layers [{layer}, {layer + k}) of {self.layers}")
        flat, per = host_bytes(stacked), self.per_layer
        runs = [flat[i * per : (i + 1) * per] for i in range(k * n)]  # layer-major
        self._send(layer, k, lambda j: runs[j * n : (j + 1) * n])

    def _check_next(self, layer: int) -> None:
        self._check_live()
        if layer != self._next:
            raise InvalidValue(f"layer {layer} written after layers [0, {self._next})")

    def _send(self, layer: int, k: int, parts_of: Callable[[int], list[Any]]) -> None:
        """Send layers [layer, layer + k), each as ``parts_of(j)`` (one run per item, in
        key order); a failure aborts the write."""
        try:
            self._send_runs(layer, k, parts_of)
        except BaseException:
            self.abort()
            raise
        self._next = layer + k

    def commit(self, keep: Sequence[bool] | None = None) -> list[bool | KVStoreError | None]:
        """Store every block whose ``keep`` is true (all by default): per key True
        (stored), False (stored already), None (withdrawn) or its error."""
        self._check_live()
        if self._next != self.layers:
            raise InvalidValue(f"commit after layers [0, {self._next}) of {self.layers}")
        flags = [True] * len(self.keys) if keep is None else [bool(k) for k in keep]
        if len(flags) != len(self.keys):
            raise InvalidValue(f"{len(flags)} keep flags for {len(self.keys)} keys")
        self._done = True
        results = self._finish(flags)
        if self.on_commit is not None:
            self.on_commit(results)
        return results

    @abstractmethod
    def abort(self) -> None:
        """Store nothing of this write and free its reservations; idempotent."""

    @abstractmethod
    def _send_runs(self, layer: int, k: int, parts_of: Callable[[int], list[Any]]) -> None:
        """Move layers [layer, layer + k); ``parts_of(j)`` is layer ``layer + j``'s run
        of each item, in key order."""

    @abstractmethod
    def _finish(self, flags: list[bool]) -> list[bool | KVStoreError | None]:
        """Commit the items whose flag is set (the write is already marked done)."""

    def _check_live(self) -> None:
        if self._done:
            raise ReservationError("this layer-by-layer write was already committed or aborted")

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout


class LinkLayeredPut(LayeredPut):
    """A layer-by-layer write to one node over one link.

    Made by ``NodeClient.begin_layers``, which starts the write on a link (retried
    like any call while nothing is sent). Each item's checksum is a stream over its
    layers, updated after each run has left (while the server receives it).
    """

    def __init__(
        self,
        links: Links,
        keys: Sequence[bytes],
        info: ValueInfo,
        link: Link,
        sink: LayerSink,
        timeout_s: float,
    ) -> None:
        super().__init__(keys, info, timeout_s)
        self._links = links
        self._sums = [checksum_stream() for _ in self.keys]
        self._link: Link | None = link  # given back to ``links`` at the commit or abort
        self._sink = sink

    def _send_runs(self, layer: int, k: int, parts_of: Callable[[int], list[Any]]) -> None:
        for j in range(k):
            parts = parts_of(j)
            self._sink.send(parts, self._deadline())
            for h, part in zip(self._sums, parts, strict=True):
                h.update(part)

    def _finish(self, flags: list[bool]) -> list[bool | KVStoreError | None]:
        sums = [h.intdigest() for h in self._sums]
        try:
            return list(self._sink.finish(sums, flags, self._deadline()))
        except BaseException:
            self._sink.abort(self._deadline())
            raise
        finally:
            self._give_back()

    def abort(self) -> None:
        """Store nothing of this write and free its reservations; idempotent."""
        if self._link is None:
            return
        self._done = True
        try:
            self._sink.abort(self._deadline())
        finally:
            self._give_back()

    def _give_back(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            self._links.give_back(link)


class AsyncLayeredPut:
    """asyncio facade of a :class:`LayeredPut` (``AsyncStoreClient.begin_layers``): each
    step runs on the client's thread pool. Await each step before the next: the write
    holds one connection, used by one thread at a time. Leaving ``async with`` without
    a commit aborts, as the sync form does."""

    def __init__(self, put: LayerWrite, run: Callable[..., Awaitable[Any]]) -> None:
        self.sync = put
        self._run = run

    async def __aenter__(self) -> AsyncLayeredPut:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.sync.done:
            await self.abort()

    @property
    def keys(self) -> list[bytes]:
        """The blocks being written, in order."""
        return self.sync.keys

    @property
    def written(self) -> int:
        """Layers written so far."""
        return self.sync.written

    async def write(self, layer: int, values: Sequence[Any]) -> None:
        """See :meth:`LayeredPut.write`."""
        await self._run(self.sync.write, layer, values)

    async def write_stacked(self, layer: int, stacked: Any) -> None:
        """See :meth:`LayeredPut.write_stacked`."""
        await self._run(self.sync.write_stacked, layer, stacked)

    async def commit(self, keep: Sequence[bool] | None = None) -> list[bool | KVStoreError | None]:
        """See :meth:`LayeredPut.commit`."""
        results: list[bool | KVStoreError | None] = await self._run(self.sync.commit, keep)
        return results

    async def abort(self) -> None:
        """See :meth:`LayeredPut.abort`."""
        await self._run(self.sync.abort)
