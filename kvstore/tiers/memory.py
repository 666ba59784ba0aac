"""DRAM and HBM tiers: one preallocated slab each, carved by an extent allocator.

DRAM lives in a named POSIX shared-memory segment (``/dev/shm/<name>``) so a client
on the same host can map it and copy a block out directly, under a pin granted by
the node; or, when the node shares it with nobody (a server of several tenants), in
anonymous private memory that no other process can open. A segment is named by its
owner's pid and locked while open, so the segments of crashed nodes are reclaimed when
the next node starts (kvstore/shm/segment.py). When
CUDA exists it is also registered as pinned memory so GPU copies from it run at full
PCIe speed. HBM is one CUDA ``uint8`` tensor. Both are touched
page by page at start: fresh pages fault on first touch at a fraction of memcpy
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
from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader, checksum, copy_payload, host_bytes
from kvstore.errors import ClosedError, ConfigError
from kvstore.shm.segment import SHM_DIR, hold_segment, map_segment, owned_name, sweep_stale
from kvstore.tier_kinds import TierKind
from kvstore.tiers.alloc import ExtentAllocator
from kvstore.tiers.base import HostPayload, Payload, Tier

_PAGE = mmap.PAGESIZE

__all__ = ["DevicePayload", "MemoryTier"]


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
        pin: bool = True,
    ) -> None:
        if kind is TierKind.SSD:
            raise ConfigError("MemoryTier is for HBM or DRAM")
        self.kind = kind
        self._alloc = ExtentAllocator(capacity, align)
        self._closed = False
        self._registered = False
        self._mm: mmap.mmap | None = None
        self._hold_fd: int | None = None
        if kind is TierKind.DRAM:
            self._mm = self._map_dram(shm_name, shared)
            self._host = np.frombuffer(self._mm, dtype=np.uint8)
            if warm:
                self._host[::_PAGE] = 0
            if pin:
                self._pin_host()
        else:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("an HBM tier needs CUDA, and torch sees no CUDA device")
            self._dev = torch.empty(self._alloc.capacity, dtype=torch.uint8, device=device)
            if warm:
                self._dev.zero_()

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

    # -- bytes -------------------------------------------------------------------------

    def payload(self, place: int, nbytes: int) -> Payload:
        """The payload of the extent at ``place``, in place: host bytes (DRAM) or a
        CUDA tensor's (HBM)."""
        start = place + HEADER_SIZE
        if self.kind is TierKind.DRAM:
            return HostPayload(self._host[start : start + nbytes])
        return DevicePayload(self._dev[start : start + nbytes])

    def seal(self, place: int, header: BlockHeader) -> None:
        self._check_open()
        raw = header.pack()
        if self.kind is TierKind.DRAM:
            self._host[place : place + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            return
        import torch

        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._dev[place : place + len(raw)].copy_(src)

    def store(self, key: bytes, place: int, header: BlockHeader, src: Payload) -> None:
        self._check_open()
        self.seal(place, header)
        self.payload(place, header.payload_len).write(src)

    def load(self, key: bytes, place: int, header: BlockHeader, dst: Payload) -> None:
        dst.write(self.payload(place, header.payload_len))

    # -- lifecycle ---------------------------------------------------------------------

    def _pin_host(self) -> None:
        # Importing torch costs about a second; a host without an NVIDIA device node
        # cannot use pinned memory, so do not pay for the import there.
        if not os.path.exists("/dev/nvidiactl") and "torch" not in sys.modules:
            return
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        ptr = self._host.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self._alloc.capacity, 0)
        self._registered = int(err) == 0

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.kind.value} tier is closed")

    def close(self) -> None:
        """Unmap and unlink the segment (or free the CUDA slab); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._mm is not None:
            if self._registered:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._host.ctypes.data)
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
        else:
            del self._dev


def _is_cuda(value: Any) -> bool:
    dev = getattr(value, "device", None)
    return dev is not None and getattr(dev, "type", "cpu") == "cuda"


class DevicePayload(Payload):
    """Payload bytes in HBM (a CUDA uint8 tensor view): the one place device bytes are
    copied to or from host memory for the node."""

    __slots__ = ("_staging", "_t", "nbytes")

    def __init__(self, t: Any) -> None:
        self._t = t
        self._staging: np.ndarray | None = None
        self.nbytes = int(t.numel())

    def host(self) -> np.ndarray:
        return np.asarray(self._t.cpu().numpy())

    def copy_to(self, header: BlockHeader, out: Any) -> None:
        if _is_cuda(out) and out.numel() * out.element_size() == header.payload_len:
            import torch

            out.reshape(-1).view(torch.uint8).copy_(self._t)
            return
        copy_payload(header, self.host(), out)  # a host out, or the size mismatch raised

    def fill_buffer(self) -> np.ndarray:
        if self._staging is None:
            self._staging = np.empty(self.nbytes, dtype=np.uint8)
        return self._staging

    def write(self, value: Any) -> None:
        import torch

        self._staging = None
        if isinstance(value, DevicePayload):
            src = value._t
        elif isinstance(value, Payload):
            src = torch.from_numpy(value.host())
        elif hasattr(value, "untyped_storage"):
            src = value.detach().reshape(-1).view(torch.uint8)
        else:
            src = torch.from_numpy(np.frombuffer(host_bytes(value), dtype=np.uint8))
        self._t.copy_(src)

    def flush(self) -> None:
        if self._staging is not None:
            import torch

            self._t.copy_(torch.from_numpy(self._staging))

    def checksum(self) -> int:
        return checksum(self.host() if self._staging is None else self._staging)
