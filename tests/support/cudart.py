"""A cudart-like object for the registry's tests: the two calls the registry makes
(kvstore/copies/registry.py), keeping what is registered, refusing what the driver
refuses, failing where a test says."""

from __future__ import annotations

__all__ = ["RecordingCudart"]


class RecordingCudart:
    """The two runtime calls, keeping what is registered; ``fail_at``: the n-th
    register call (0-based) returns an error code; ``already`` refuses a range that is
    registered, as the driver does."""

    def __init__(self, fail_at: int | None = None, raises: bool = False) -> None:
        self.fail_at = fail_at
        self.raises = raises
        self.calls: list[tuple[str, int, int]] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        n = sum(1 for c in self.calls if c[0] == "register")
        self.calls.append(("register", ptr, size))
        if self.raises:
            raise RuntimeError("CUDA driver version is insufficient")
        if n == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        if any(p < ptr + size and ptr < p + s for p, s in self.registered.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.registered.pop(ptr, None) is not None else 713
