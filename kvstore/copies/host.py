"""The copy engine on host memory (the seam: engine.py): CPU torch tensors and numpy
arrays, so the batching, staging and ordering logic of every caller (the node's HBM
tier over host memory, ``hbm_device="cpu"``; a client's device paths given this engine)
runs, and is tested, on a machine without CUDA.

With ``deferred`` (the default) a batch's copy runs only when an event after it is
waited for, as a stream would run it later: code that read a destination before
waiting, or checked a source's slot before its copy ran, sees the bug on CPU too.
Ordered copies (``write``, ``read``) run at once: on a device the caller's stream is
ordered after them, so whatever reads their bytes next sees them done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.copies.engine import Batch, Completion, CopyEngine, Staged
from kvstore.errors import DeviceError

__all__ = ["HostCopyEngine"]


def _np(buf: Any) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


def _now(dst: Any, src: Any) -> None:
    """An ordered copy, run at once: tensor to tensor as torch copies (from any
    device), a numpy side (a staging buffer) byte for byte."""
    if not isinstance(dst, np.ndarray) and not isinstance(src, np.ndarray):
        dst.copy_(src)
        return
    d, s = _np(dst), _np(src)
    if d.nbytes != s.nbytes:
        raise DeviceError(f"copy of {s.nbytes} bytes into {d.nbytes}")
    np.copyto(d, s)


class _HostCompletion(Completion):
    __slots__ = ("batch", "upto")

    def __init__(self, batch: _HostBatch, upto: int) -> None:
        self.batch = batch
        self.upto = upto

    def wait(self) -> None:
        self.batch._run(self.upto)


class _HostBatch(Batch):
    """Copies kept in order and run when a later event is waited for (``deferred``)
    or at once."""

    def __init__(self, engine: HostCopyEngine) -> None:
        super().__init__(engine)
        self._deferred = engine.deferred
        self._queue: list[tuple[np.ndarray, np.ndarray]] = []
        self._ran = 0  # copies of _queue already run

    def _add(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
        for d, s in zip(dsts, srcs, strict=True):
            dv, sv = _np(d), _np(s)
            if dv.nbytes != sv.nbytes:
                raise DeviceError(f"copy of {sv.nbytes} bytes into {dv.nbytes}")
            self._queue.append((dv, sv))
        self.engine.stats["copies"] += len(dsts)
        if not self._deferred:
            self._run(len(self._queue))

    def h2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._add(dsts, srcs)

    def d2h(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._add(dsts, srcs)

    def d2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._add(dsts, srcs)

    def mark(self) -> Completion:
        return _HostCompletion(self, len(self._queue))

    def _run(self, upto: int) -> None:
        if self._ran < upto:
            self.engine.stats["waits"] += 1
        while self._ran < upto:
            dst, src = self._queue[self._ran]
            np.copyto(dst, src)
            self._ran += 1


def _cpu_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and getattr(value, "is_cpu", False) is True


class HostCopyEngine(CopyEngine):
    """The copy contract on host memory: by default it claims CPU torch tensors, so a
    client given this engine moves them through the device paths (what the CPU tests
    do). ``claims``: another predicate; ``deferred``: run copies only when waited for."""

    name = "host"

    def __init__(self, claims: Callable[[Any], bool] | None = None, *, deferred: bool = True):
        super().__init__()
        self._claims = claims or _cpu_tensor
        self.deferred = deferred

    def claims(self, value: Any) -> bool:
        return self._claims(value)

    def begin(self, device: Any, *, after_caller: bool = True, after_slab: bool = False) -> Batch:
        self.stats["batches"] += 1
        return _HostBatch(self)

    def staging(self, n: int) -> Staged:
        buf = np.empty(n, dtype=np.uint8)
        return Staged(buf, buf)

    def slab(self, nbytes: int, device: Any) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        _now(dst, src)

    def read(self, dst: Any, src: Any) -> None:
        _now(dst, src)
