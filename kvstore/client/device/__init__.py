"""The CUDA landing: how the client moves blocks between the node's host memory and CUDA
tensors without touching the bytes on the CPU.

- registry.py: the client's mapping of the node's DRAM segment registered with CUDA,
  once per process per mapping, in chunks of at most 64 GiB;
- copier.py: the copy engine seam (one batch of async copies on a pooled side stream,
  ordered after the caller's stream by an event, one wait per batch), with a CUDA and a
  host implementation;
- staging.py: a ring of pinned buffers for what cannot DMA from the segment (a network
  receive, an unregistered segment);
- reads.py / writes.py: one call's copies into device tensors and out of them.

Nothing here imports torch until a CUDA tensor (or a test's host engine) is seen:
:func:`is_cuda` reads the value's own attributes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_cuda"]


def is_cuda(value: Any) -> bool:
    """Whether ``value`` is a torch tensor on a CUDA device (without importing torch)."""
    return type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False) is True
