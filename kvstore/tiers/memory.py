"""DRAM and HBM tiers: one preallocated slab each, carved by an extent allocator.

DRAM lives in a named POSIX shared-memory segment (``/dev/shm/<name>``) so a client
on the same host can map it and copy a block out directly, under a pin granted by
the node; when CUDA exists it is also registered as pinned memory so GPU copies
from it run at full PCIe speed. HBM is one CUDA ``uint8`` tensor. Both are touched
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

from kvstore.blocks import HEADER_SIZE, BlockHeader, copy_payload, host_bytes
from kvstore.errors import ClosedError, ConfigError
from kvstore.shm.segment import SHM_DIR, map_segment
from kvstore.tiering import TierKind
from kvstore.tiers.alloc import ExtentAllocator
from kvstore.tiers.base import Tier

_PAGE = mmap.PAGESIZE

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """A DRAM (shared memory) or HBM (CUDA tensor) slab of fixed capacity."""

    def __init__(
        self,
        kind: TierKind,
        capacity: int,
        *,
        shm_name: str | None = None,
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
        self.shm_name: str | None = None
        if kind is TierKind.DRAM:
            self.shm_name = shm_name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
            if shm_name:
                # A configured name belongs to this node: a segment left under it is the
                # previous incarnation's (killed before it could unlink), so replace it.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, shm_name))
            self._mm = map_segment(self.shm_name, self._alloc.capacity, create=True)
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

    # -- bytes -------------------------------------------------------------------------

    def write_header(self, offset: int, header: bytes) -> None:
        """Store a packed header at the start of an extent."""
        self._check_open()
        if self.kind is TierKind.DRAM:
            self._host[offset : offset + len(header)] = np.frombuffer(header, dtype=np.uint8)
            return
        import torch

        src = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._dev[offset : offset + len(header)].copy_(src)

    def write_payload(self, offset: int, payload: Any) -> None:
        """Copy a payload (tensor, array, bytes or another tier's view) into an extent."""
        self._check_open()
        start = offset + HEADER_SIZE
        if self.kind is TierKind.DRAM and not _is_cuda(payload):
            src = np.frombuffer(host_bytes(payload), dtype=np.uint8)
            np.copyto(self._host[start : start + src.size], src, casting="no")
            return
        import torch

        if hasattr(payload, "untyped_storage"):
            src_t = payload.detach().reshape(-1).view(torch.uint8)
        else:
            src_t = torch.from_numpy(np.frombuffer(host_bytes(payload), dtype=np.uint8))
        dst = self._dev if self.kind is TierKind.HBM else torch.from_numpy(self._host)
        dst[start : start + src_t.numel()].copy_(src_t)

    def header(self, offset: int) -> BlockHeader:
        """Parse the header stored at ``offset``."""
        return BlockHeader.unpack(self.header_bytes(offset))

    def header_bytes(self, offset: int) -> bytes:
        """The raw header bytes at ``offset``."""
        if self.kind is TierKind.DRAM:
            return self._host[offset : offset + HEADER_SIZE].tobytes()
        return bytes(self._dev[offset : offset + HEADER_SIZE].cpu().numpy())

    def payload(self, offset: int, length: int) -> Any:
        """A view of the payload bytes: a numpy uint8 array (DRAM) or a CUDA tensor (HBM)."""
        start = offset + HEADER_SIZE
        if self.kind is TierKind.DRAM:
            return self._host[start : start + length]
        return self._dev[start : start + length]

    def copy_out_tensor(self, src: Any, header: BlockHeader, out: Any) -> None:
        """Copy an HBM payload view into ``out`` (a CUDA tensor stays on the device)."""
        if _is_cuda(out):
            import torch

            if out.numel() * out.element_size() != header.payload_len:
                copy_payload(header, src.cpu().numpy(), out)  # raises the size mismatch
                return
            out.reshape(-1).view(torch.uint8).copy_(src)
            return
        copy_payload(header, src.cpu().numpy(), out)

    def host_view(self, offset: int, length: int) -> memoryview:
        """A memoryview over a DRAM range (for the SSD tier to write from, without a copy)."""
        if self.kind is not TierKind.DRAM:
            return memoryview(self.payload(offset, length).cpu().numpy())
        return memoryview(self._host[offset : offset + length])  # type: ignore[arg-type]

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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.shm_name or ""))
        else:
            del self._dev


def _is_cuda(value: Any) -> bool:
    dev = getattr(value, "device", None)
    return dev is not None and getattr(dev, "type", "cpu") == "cuda"
