"""The device half of one transport: which values take the device paths, the engine
that moves them, and the transport's registration of the node's segment.

A transport asks :meth:`DeviceSide.takes` of a call's outputs (or values) first: only
when every one is the engine's (a CUDA tensor, for the default engine) does the call take
a device path; anything else keeps today's host path, untouched (no torch import, one
attribute check of the first value). The CUDA engine is the process's (kvstore/copies/cuda.py:
made on the first CUDA tensor, its side streams pooled per device, shared with a node
in the same process); the segment is registered on the first device call that needs it,
in the process's registry (kvstore/copies/registry.py), and released by :meth:`close`,
which the transport calls before it unmaps the segment.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.copies.cuda import process_engine
from kvstore.copies.engine import CopyEngine, is_cuda
from kvstore.copies.registry import HostRegistry, Registration, process_registry

__all__ = ["DeviceSide"]


_WHAT = "the client's mapping of the node's segment"


class DeviceSide:
    """What a transport needs to move a call's bytes to or from device tensors.

    Thread-safe: ``_lock`` guards the one registration (made once, released once)."""

    def __init__(
        self,
        engine: CopyEngine | None = None,
        registry: HostRegistry | None = None,
        segment: np.ndarray | None = None,
    ) -> None:
        self._engine = engine  # None: the process's CUDA engine, on the first CUDA tensor
        self._registry = registry
        self.segment = segment  # the transport's mapping of the node's segment, uint8
        self._lock = threading.Lock()
        self._reg: Registration | None = None
        self._closed = False

    def takes(self, values: Sequence[Any] | None) -> bool:
        """Whether a call over ``values`` takes the device path (all are claimed)."""
        if not values:
            return False
        claims = self._engine.claims if self._engine is not None else is_cuda
        return all(claims(v) for v in values)

    @property
    def engine(self) -> CopyEngine:
        """The engine that moves this transport's device bytes."""
        if self._engine is None:
            self._engine = process_engine()
        return self._engine

    def registration(self) -> Registration | None:
        """The segment's registration (made on first call; ``pinned`` says whether
        copies may DMA from it), or None without a segment."""
        if self.segment is None:
            return None
        with self._lock:
            if self._reg is None and not self._closed:
                registry = self._registry or process_registry()
                self._registry = registry
                self._reg = registry.register(
                    self.segment.ctypes.data, int(self.segment.size), _WHAT
                )
            return self._reg

    def close(self) -> None:
        """Release the registration (before the segment is unmapped); idempotent."""
        with self._lock:
            self._closed = True
            reg, self._reg = self._reg, None
        if reg is not None and self._registry is not None:
            self._registry.release(reg)
