"""DRAM and HBM tiers: one preallocated slab each, carved by an extent allocator.

DRAM lives in a named POSIX shared-memory segment (``/dev/shm/<name>``) so a client
on the same host can map it and copy a block out directly, under a pin granted by
the node; or, when the node shares it with nobody (a server of several tenants), in
anonymous private memory that no other process can open. A segment is named by its
owner's pid and locked while open, so the segments of crashed nodes are reclaimed when
the next node starts (kvstore/shm/segment.py). When
CUDA exists it is also registered with CUDA (the process's registry,
kvstore/copies/registry.py: in chunks, every return code checked), so a CUDA tensor is
put with D2H copies straight into its extent, on a side stream ordered after the
producer's, hashed on the host piece by piece as the pieces land, and read with one H2D
copy straight out of it (kvstore/copies/landing.py), every straight copy cut where it
crosses a registered chunk's boundary; when registration fails, both go through pinned
staging, said once in the log. In a batch (StoreNode.batch_put / batch_get_into) each
block's copy is queued on the call's batch instead: one submission, one wait. HBM is
one device ``uint8`` tensor (kvstore/tiers/hbm.py: D2D puts and reads, checksums off
the critical path). Both are
touched page by page at start: fresh pages fault on first touch at a fraction of memcpy
speed, and that cost belongs to start-up, not to the first requests.

A block occupies one extent: the 128-byte header, then the payload. The tier does
no locking of its own; the node serializes ``alloc``/``free`` under its lock and
copies bytes outside it while the extent is pinned or reserved.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import sys
import threading
from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader, out_view
from kvstore.copies.cuda import engine_for
from kvstore.copies.engine import Batches, CopyEngine
from kvstore.copies.landing import Pinned, arrive, depart, land_hashed, lift
from kvstore.copies.registry import HostRegistry, Registration, process_registry
from kvstore.errors import ClosedError, ConfigError
from kvstore.shm.segment import SHM_DIR, hold_segment, map_segment, owned_name, sweep_stale
from kvstore.tier_kinds import TierKind
from kvstore.tiers.alloc import ExtentAllocator
from kvstore.tiers.base import HostPayload, Payload, Pending, Tier
from kvstore.tiers.hbm import DevicePayload, DeviceSlab

_PAGE = mmap.PAGESIZE

__all__ = ["DevicePayload", "MemoryTier", "SlabPayload"]


class MemoryTier(Tier):
    """A DRAM (shared memory) or HBM (CUDA tensor) slab of fixed capacity."""

    def __init__(
        self,
        kind: TierKind,
        capacity: int,
        *,
        shm_name: str | None = None,
        shared: bool = True,
        device: str = "cuda",
        warm: bool = True,
        align: int = 256,
        pin: bool | None = None,
    ) -> None:
        if kind is TierKind.SSD:
            raise ConfigError("MemoryTier is for HBM or DRAM")
        self.kind = kind
        self._alloc = ExtentAllocator(capacity, align)
        self._closed = False
        self._mm: mmap.mmap | None = None
        self._hold_fd: int | None = None
        self._slab: DeviceSlab | None = None
        self._link = _DeviceLink()
        self._registry: HostRegistry | None = None  # the one the DRAM slab is registered in
        if kind is TierKind.DRAM:
            self._mm = self._map_dram(shm_name, shared)
            self._host = np.frombuffer(self._mm, dtype=np.uint8)
            if warm:
                self._host[::_PAGE] = 0
            if pin is not False:
                self._pin_host(import_torch=bool(pin))
        else:
            self._slab = DeviceSlab(self._alloc.capacity, device, warm=warm)

    def _map_dram(self, shm_name: str | None, shared: bool) -> mmap.mmap:
        """The DRAM slab: a named segment same-host clients map, or (not ``shared``)
        anonymous private memory nothing outside this process can open."""
        if not shared:
            if shm_name:
                raise ConfigError("shm_name: a private DRAM tier has no segment to name")
            self.shm_name = None
            return mmap.mmap(-1, self._alloc.capacity)
        self.shm_name = shm_name or owned_name(secrets.token_hex(4))
        if shm_name:
            # A configured name belongs to this node: a segment left under it is the
            # previous incarnation's (killed before it could unlink), so replace it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, shm_name))
        else:  # named by pid: crashed nodes' segments are found and reclaimed
            sweep_stale()
        mm = map_segment(self.shm_name, self._alloc.capacity, create=True)
        self._hold_fd = hold_segment(self.shm_name)
        return mm

    # -- space -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used(self) -> int:
        return self._alloc.used

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh extent of ``nbytes`` (header included), or None if full."""
        self._check_open()
        return self._alloc.alloc(nbytes)

    def free(self, offset: int) -> int:
        """Release an extent; returns the bytes freed."""
        return self._alloc.free(offset)

    def allocate(self, nbytes: int) -> int | None:
        return self.alloc(nbytes)

    def release(self, key: bytes, place: int) -> None:
        self.free(place)
        if self._slab is not None:
            self._slab.release(place)

    @property
    def registered(self) -> bool:
        """Whether the DRAM slab is registered with CUDA (device copies go straight in
        and out of it; otherwise through pinned staging)."""
        return self._link.registered

    def wait_hashed(self, timeout: float = 10.0) -> bool:
        """HBM: wait until every block committed so far has its checksum (the
        background hasher's, or a departure's); True when it did. DRAM: True."""
        return True if self._slab is None else self._slab.wait_hashed(timeout)

    # -- bytes -------------------------------------------------------------------------

    def payload(self, place: int, nbytes: int) -> Payload:
        """The payload of the extent at ``place``, in place: host bytes (DRAM) or a
        device tensor's (HBM)."""
        if self._slab is not None:
            return self._slab.payload(place, nbytes)
        start = place + HEADER_SIZE
        return SlabPayload(self._host[start : start + nbytes], self._link)

    def seal(self, place: int, header: BlockHeader) -> None:
        self._check_open()
        if self._slab is not None:  # HBM: headers stay in the index (hbm.py)
            self._slab.seal(place, header)
            return
        raw = header.pack()
        self._host[place : place + len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def store(self, key: bytes, place: int, header: BlockHeader, src: Payload) -> BlockHeader:
        self._check_open()
        dst = self.payload(place, header.payload_len)
        if isinstance(dst, SlabPayload):  # into DRAM: the bytes land in the extent
            header, _ = src.land(header, dst.fill_buffer(), pinned=self._link.locked)
        else:
            dst.write(src)
        self.seal(place, header)
        return header

    def load(self, key: bytes, place: int, header: BlockHeader, dst: Payload) -> None:
        dst.write(self.payload(place, header.payload_len))

    # -- lifecycle ---------------------------------------------------------------------

    def _pin_host(self, *, import_torch: bool) -> None:
        # Registering is for copies between this slab and a GPU made in this process:
        # a node with an HBM tier (``pin=True``: import torch for it), or one embedded
        # in a process that already imported torch (an engine's; ``pin=None``). A store
        # server without HBM makes none (its clients register the segment in their own
        # processes), so it neither imports torch (about a second) nor starts a CUDA
        # context (seconds and some GPU memory, in each shard).
        if "torch" not in sys.modules and (
            not import_torch or not os.path.exists("/dev/nvidiactl")
        ):
            return
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        self._register(process_registry())

    def _register(self, registry: HostRegistry) -> None:
        what = f"the node's DRAM slab {self.shm_name or '(private)'}"
        self._link.reg = registry.register(self._host.ctypes.data, self.capacity, what)
        self._registry = registry

    def _unregister(self) -> None:
        reg, self._link.reg = self._link.reg, None
        if reg is not None and self._registry is not None:
            self._registry.release(reg)
        self._registry = None

    def use_copies(
        self, engine: CopyEngine | None = None, registry: HostRegistry | None = None
    ) -> None:
        """DRAM only, before the first copy: move the slab's device copies with
        ``engine`` (for the values it claims: the host engine claims CPU tensors, so
        the CPU tests run the device paths), and/or register the slab in ``registry``
        instead of the process's (a test's cudart with small chunks)."""
        if self._slab is not None:
            raise ConfigError("use_copies is for a DRAM tier")
        self._link.fixed = engine
        if registry is not None:
            self._unregister()
            self._register(registry)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.kind.value} tier is closed")

    def close(self) -> None:
        """Unmap and unlink the segment (or free the CUDA slab); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._mm is not None:
            self._unregister()
            del self._host
            # a caller may still hold a view; the mapping then goes when the view does
            with contextlib.suppress(BufferError):
                self._mm.close()
            if self.shm_name is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, self.shm_name))
            if self._hold_fd is not None:
                os.close(self._hold_fd)
                self._hold_fd = None
        elif self._slab is not None:
            self._slab.close()


class _DeviceLink:
    """What a DRAM slab's payloads need to copy to and from devices: the slab's
    registration with CUDA (``reg``), and the copy engine of each device, chosen on
    first use (kvstore/copies/cuda.py ``engine_for``: the process's CUDA engine for
    CUDA), or ``fixed`` for the values it claims (MemoryTier.use_copies)."""

    __slots__ = ("_engines", "_lock", "fixed", "reg")

    def __init__(self) -> None:
        self.reg: Registration | None = None
        self.fixed: CopyEngine | None = None
        self._engines: dict[Any, CopyEngine] = {}
        self._lock = threading.Lock()

    @property
    def registered(self) -> bool:
        return self.reg is not None and self.reg.pinned

    @property
    def locked(self) -> Pinned:
        """The slab's page-locking, for the landing helpers (copies/landing.py)."""
        return self.reg if self.reg is not None and self.reg.pinned else False

    def engine_of(self, value: Any) -> CopyEngine | None:
        """The engine that copies ``value`` (a tensor to put, an output) to or from the
        slab; None for host memory, copied by the CPU."""
        if self.fixed is not None:
            return self.fixed if self.fixed.claims(value) else None
        if not _on_device(value):
            return None
        eng = self._engines.get(value.device)
        if eng is None:
            with self._lock:
                eng = self._engines.setdefault(value.device, engine_for(value.device))
        return eng


def _on_device(value: Any) -> bool:
    if isinstance(value, Payload):
        return False
    dev = getattr(value, "device", None)
    return dev is not None and getattr(dev, "type", "cpu") != "cpu"


class SlabPayload(HostPayload):
    """A DRAM extent's payload: host bytes that device tensors are copied into and out
    of through the slab's copy engines (straight when it is registered)."""

    __slots__ = ("_link",)

    def __init__(self, arr: np.ndarray, link: _DeviceLink) -> None:
        super().__init__(arr)
        self._link = link

    def write(self, value: Any) -> int | None:
        """A device tensor lands by D2H pieces on a side stream ordered after the
        producer's, each hashed as it lands: returns that xxh3 (the commit's landed
        checksum); anything else is copied as HostPayload copies it."""
        engine = self._link.engine_of(value)
        if engine is None:
            return super().write(value)
        src = CopyEngine.flat(value.detach())
        return land_hashed(engine, src, self._arr, pinned=self._link.locked)

    def queue_write(self, value: Any, batches: Batches) -> Pending | None:
        """A device tensor's D2H, queued with an event of its own: its pending write
        hashes the host bytes once that event completed."""
        engine = self._link.engine_of(value)
        if engine is None:
            return None
        src = CopyEngine.flat(value.detach())
        return Pending(depart(engine, batches, src, self._arr, self._link.locked).landed)

    def copy_to(self, header: BlockHeader, out: Any) -> None:
        engine = self._link.engine_of(out)
        if engine is None:
            super().copy_to(header, out)
            return
        out_view(header, out)  # the layout check
        lift(engine, self._arr, CopyEngine.flat(out), pinned=self._link.locked)

    def queue_copy_to(self, header: BlockHeader, out: Any, batches: Batches) -> bool:
        engine = self._link.engine_of(out)
        if engine is None:
            return False
        out_view(header, out)
        dst = CopyEngine.flat(out)
        stage = arrive(engine, batches.on(engine, dst.device), self._arr, dst, self._link.locked)
        if stage is not None:
            batches.keep(stage)
        return True
