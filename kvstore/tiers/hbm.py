"""The HBM tier's slab: blocks in one device tensor, put and read device to device,
hashed off the critical path.

A put from a device tensor is one D2D copy on the copy engine's ordered stream
(kvstore/copies/engine.py), ordered after the producer's stream by an event, the
producer's stream then ordered after the copy; the host does not wait for it, and the
put commits the block with its checksum *pending*. A get_into a device
tensor is one D2D copy on the same stream, the caller's stream ordered after it: no
host round trip and no allocation beyond a view. Because every asynchronous copy
into or out of the slab runs on that one stream, a place released after a read was
enqueued can only be rewritten after that read ran.

The checksum rule (README.md, "Guarantees"; the bookkeeping in hashbook.py): a pending
block gets its first checksum from a background hasher once the tier is quiet, or
from its first departure, whichever comes first; *every* departure from the GPU (a
demotion, a network read, a copy into a host buffer) copies the bytes to host memory
and hashes them as they land, and checks them against the checksum known, so a block
never leaves the GPU unhashed, and a device byte corrupted after the first checksum
is caught as it leaves (CorruptBlock: the node drops the block and answers a miss).
In-device reads (get_into a tensor on the slab's device) are not checked, as DRAM
reads are not.

A batch of puts or reads (StoreNode.batch_put / batch_get_into) queues its D2D copies
on the call's side-stream batch instead, ordered after the caller's stream and the
ordered stream (so after any ordered write still in flight, and after any ordered read
of a place since reused), and the call waits once before it commits (puts: still with
the checksum pending) or unpins (reads).

Headers are not written to the device: a block's header lives in the node's index,
and 128 bytes copied to the device per put would be a synchronizing copy as long as
the payload's. The extent keeps its HEADER_SIZE bytes, so places have one layout in
every memory tier.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader, checksum, host_bytes, out_view
from kvstore.copies.cuda import CudaCopyEngine, engine_for
from kvstore.copies.engine import Batches, CopyEngine, Staged
from kvstore.copies.landing import Pinned, land_hashed
from kvstore.errors import ConfigError
from kvstore.tiers.base import Payload, Pending
from kvstore.tiers.hashbook import HashBook, Hasher

__all__ = ["DevicePayload", "DeviceSlab"]


class DeviceSlab:
    """One device tensor of blocks, its copy engine, and its checksums (a HashBook fed
    by a background Hasher). Called by MemoryTier under the node's rules: ``seal`` and
    ``release`` under the index's lock, copies on pinned or reserved places."""

    def __init__(self, capacity: int, device: str, *, warm: bool) -> None:
        import torch

        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("an HBM tier needs CUDA, and torch sees no CUDA device")
        self.engine: CopyEngine = engine_for(device)
        self.tensor = self.engine.slab(capacity, device)
        if warm:
            self.tensor.zero_()
        if self.on_cuda:  # the zeroing ran on the default stream: done before any copy
            torch.cuda.synchronize(self.tensor.device)
        self.book = HashBook()
        self._hasher = Hasher(self.book, self.digest)

    @property
    def on_cuda(self) -> bool:
        return isinstance(self.engine, CudaCopyEngine)

    def payload(self, place: int, nbytes: int) -> DevicePayload:
        start = place + HEADER_SIZE
        return DevicePayload(self, place, self.tensor[start : start + nbytes])

    def seal(self, place: int, header: BlockHeader) -> None:
        self.book.sealed(place, header.payload_len, header.checksum)

    def release(self, place: int) -> None:
        self.book.forget(place)

    def land(
        self, place: int, t: Any, header: BlockHeader, into: np.ndarray | None, pinned: Pinned
    ) -> tuple[BlockHeader, np.ndarray]:
        """The departure of the block at ``place`` (see the module docstring)."""
        if into is None:
            into, pinned = self.engine.staging(int(t.numel())).view, True
        landed = self._land(t, into, pinned)
        return self.book.settle(place, header, landed), into

    def digest(self, place: int, nbytes: int) -> int:
        """The xxh3 of the payload at ``place``, landed in pinned staging (the hasher's)."""
        start = place + HEADER_SIZE
        return self.hash_view(self.tensor[start : start + nbytes])

    def hash_view(self, t: Any) -> int:
        return self._land(t, self.engine.staging(int(t.numel())).view, True)

    def _land(self, t: Any, into: np.ndarray, pinned: Pinned) -> int:
        # after the slab's ordered stream (the put that wrote the bytes), not the
        # caller's: a departure or the hasher never waits for the caller's compute
        return land_hashed(self.engine, t, into, pinned=pinned, after_caller=False, after_slab=True)

    def wait_hashed(self, timeout: float) -> bool:
        """Wait until every block sealed so far has its checksum; True when it did."""
        return self.book.drained(timeout)

    def close(self) -> None:
        self._hasher.close()
        if self.on_cuda:  # a put's ordered write returns unwaited: it lands before the
            # allocator may hand the slab's memory to a tensor of another stream
            import torch

            torch.cuda.synchronize(self.tensor.device)
        del self.tensor


class DevicePayload(Payload):
    """Payload bytes in a DeviceSlab (a uint8 tensor view): the one place the node's
    device bytes are copied to or from host memory."""

    __slots__ = ("_place", "_slab", "_staging", "_t", "defers_checksum", "nbytes")

    def __init__(self, slab: DeviceSlab, place: int, t: Any) -> None:
        self._slab, self._place, self._t = slab, place, t
        self._staging: Staged | None = None  # a host buffer a fill goes through
        self.nbytes = int(t.numel())
        self.defers_checksum = False

    def host(self) -> np.ndarray:
        """The raw bytes in host memory, unchecked (departures use :meth:`land`)."""
        engine = self._slab.engine
        buf = engine.staging(self.nbytes)
        with engine.begin(self._t.device, after_caller=False, after_slab=True) as batch:
            batch.d2h([buf.part(self.nbytes)], [self._t])
        return np.asarray(buf.view[: self.nbytes])

    def _beside(self, out: Any) -> bool:
        """Whether ``out`` is a tensor on the slab's own device (an in-device read; a
        CPU tensor is one for a slab over host memory, ``hbm_device="cpu"``)."""
        return hasattr(out, "untyped_storage") and out.device == self._t.device

    def copy_to(self, header: BlockHeader, out: Any) -> None:
        dst = out_view(header, out)
        beside = self._beside(out)
        if isinstance(dst, np.ndarray) and not beside:  # the block leaves the device
            self.land(header, dst)
            return
        self._slab.engine.read(CopyEngine.flat(out) if beside else dst, self._t)

    def queue_copy_to(self, header: BlockHeader, out: Any, batches: Batches) -> bool:
        """An in-device read: one D2D copy on the call's batch."""
        if not self._beside(out):
            return False
        out_view(header, out)  # the layout check
        batches.on(self._slab.engine, self._t.device).d2d([CopyEngine.flat(out)], [self._t])
        return True

    def land(
        self, header: BlockHeader, into: np.ndarray | None = None, *, pinned: Pinned = False
    ) -> tuple[BlockHeader, np.ndarray]:
        return self._slab.land(self._place, self._t, header, into, pinned)

    def fill_buffer(self) -> np.ndarray:
        if self._staging is None:
            self._staging = self._slab.engine.staging(self.nbytes)
        return np.asarray(self._staging.view[: self.nbytes])

    def write(self, value: Any) -> int | None:
        import torch

        engine = self._slab.engine
        self._staging = None
        host = True
        if isinstance(value, DevicePayload):
            src, host = value._t, False
        elif isinstance(value, Payload):
            src = torch.from_numpy(value.host())
        elif hasattr(value, "untyped_storage"):
            src = value.detach().reshape(-1).view(torch.uint8)
            host = src.device.type == "cpu"
        else:
            arr = np.frombuffer(host_bytes(value), dtype=np.uint8)
            src = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if host and self._slab.on_cuda:
            engine.write(self._t, src, host_src=True)
        else:
            engine.write(self._t, src)
        self.defers_checksum = True
        return None

    def queue_write(self, value: Any, batches: Batches) -> Pending | None:
        """A tensor the slab's engine claims: one D2D copy on the call's batch, done when
        the batch finishes; its checksum is deferred (the module docstring)."""
        engine = self._slab.engine
        if isinstance(value, Payload) or not engine.claims(value):
            return None
        src = CopyEngine.flat(value.detach())
        batches.on(engine, self._t.device).d2d([self._t], [src])
        self._staging = None
        self.defers_checksum = True
        return Pending()

    def flush(self) -> None:
        if self._staging is not None:
            self._slab.engine.write(self._t, self._staging.part(self.nbytes), host_src=True)

    def checksum(self) -> int:
        if self._staging is not None:
            return checksum(self._staging.view[: self.nbytes])
        return self._slab.hash_view(self._t)
