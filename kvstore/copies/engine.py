"""The copy-engine seam: how bytes move between host memory and a device's memory.

Every copy the store makes to or from a device goes through a :class:`CopyEngine`, so
the decisions around the copies (which stream orders after which, when the host waits,
where a staging buffer comes from) are one piece of code whatever the device and
whoever copies: the node's tiers (an HBM slab, a DRAM slab's departures to and arrivals
from CUDA tensors) and a client's transports (reads into, puts from CUDA tensors).

Two kinds of copy:

- **A batch** (:meth:`CopyEngine.begin`): copies between host buffers and device
  tensors on a side stream, ordered after the producer's (caller's) current stream
  and/or the engine's ordered stream by an event taken at ``begin``, never by a
  device-wide synchronization. Its copies are queued without waiting,
  :meth:`Batch.mark` records an event at a point of it (what a staging slot, a put item
  or a landed piece waits on), and :meth:`Batch.finish` waits once for the whole batch.
  That is habit 18 of STYLE.md (vllm/v1/kv_offload/cpu/gpu_worker.py submits a step's
  copies the same way; SGLang's cache_controller.py waits on one event per layer).
- **An ordered copy** (:meth:`CopyEngine.write`, :meth:`CopyEngine.read`): into or out
  of device memory the engine's owner keeps (its :meth:`CopyEngine.slab`), on the
  engine's one *ordered stream* per device, so such a buffer's reads and writes run in
  submission order and a place freed after a read was enqueued cannot be rewritten
  under it. The copy waits for the caller's stream first, and the caller's stream then
  waits for the copy, both by events: what the caller queues next sees the copy done,
  and the host never waits.

The implementations: :class:`~kvstore.copies.cuda.CudaCopyEngine` (CUDA streams) and
:class:`~kvstore.copies.host.HostCopyEngine` (CPU tensors and numpy arrays, so every
caller's batching, staging and ordering logic runs, and is tested, without a GPU).
Both count what the callers' contracts promise (``stats``): batches begun, copies
queued, host waits (one per batch, plus one per mark that has to wait).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from kvstore.errors import DeviceError

__all__ = ["Batch", "Batches", "Completion", "CopyEngine", "Finishing", "Staged", "is_cuda"]


def is_cuda(value: Any) -> bool:
    """Whether ``value`` is a torch tensor on a CUDA device (without importing torch)."""
    return type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False) is True


class Completion(ABC):
    """A point of a batch: the copies queued before it are done once :meth:`wait`
    returns."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copies before this point are done (DeviceError if they
        failed)."""


class Staged:
    """A page-locked host buffer: ``view`` (flat uint8 numpy, for the host side) and
    ``handle`` (what the engine copies to or from)."""

    __slots__ = ("handle", "view")

    def __init__(self, view: np.ndarray, handle: Any) -> None:
        self.view = view
        self.handle = handle

    def part(self, n: int) -> Any:
        """The handle's first ``n`` bytes."""
        return self.handle[:n]


class Finishing(ABC):
    """Copies in flight as a context manager: leaving it calls :meth:`finish`, which
    waits for them, by an exception too (then a DeviceError of the wait is dropped
    behind the exception already raised), so no copy is in flight into a caller's
    tensor, a leased extent or a staging buffer once the block is left."""

    @abstractmethod
    def finish(self) -> None:
        """Wait for every copy queued; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self.finish()
            return
        with contextlib.suppress(DeviceError):
            self.finish()


class Batch(Finishing):
    """Copies on one stream, ordered after the streams named at ``begin``."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self._done = False

    @abstractmethod
    def h2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Queue copies of host buffers ``srcs`` (page-locked: registered memory or
        staging handles) into flat uint8 tensors ``dsts``."""

    @abstractmethod
    def d2h(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Queue copies of flat uint8 tensors ``srcs`` into host buffers ``dsts``."""

    @abstractmethod
    def d2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Queue copies of flat uint8 device tensors ``srcs`` into ``dsts`` (a device
        slab's puts and in-device reads)."""

    @abstractmethod
    def mark(self) -> Completion:
        """An event after every copy queued so far."""

    def finish(self) -> None:
        """Wait once for the whole batch and give its stream back; idempotent. Every
        path out of a batch calls it (also after a failure), so nothing is in flight
        into a caller's tensor, a lease or a staging buffer once a call returns."""
        if self._done:
            return
        try:
            self.mark().wait()
            self.engine.stats["syncs"] += 1
        finally:
            self._done = True
            self._release()

    def _release(self) -> None:
        """Give the batch's stream back (nothing for the host engine)."""


class Batches(Finishing):
    """One call's batches: one per (engine, device), begun on first use, each ordered
    after the caller's stream and, with ``after_slab``, the engine's ordered stream
    (bytes an ordered write put into a slab may still be in flight there; a place an
    ordered read was copying out of may be reused by this call). :meth:`finish` waits
    once for each batch. ``keep`` holds what the copies read or write (a staging
    buffer) until then."""

    def __init__(self, *, after_slab: bool = False) -> None:
        self._after_slab = after_slab
        self._open: dict[tuple[int, str], Batch] = {}
        self._kept: list[Any] = []

    def on(self, engine: CopyEngine, device: Any) -> Batch:
        """The call's batch of ``engine`` on ``device``."""
        key = (id(engine), str(device))
        batch = self._open.get(key)
        if batch is None:
            batch = engine.begin(device, after_slab=self._after_slab)
            self._open[key] = batch
        return batch

    def keep(self, buf: Any) -> None:
        """Keep ``buf`` alive until the batches finish."""
        self._kept.append(buf)

    def finish(self) -> None:
        """Wait once for each batch (all of them, also when one fails: then the first
        failure is raised); idempotent."""
        open_, self._open = list(self._open.values()), {}
        first: BaseException | None = None
        for batch in open_:
            try:
                batch.finish()
            except BaseException as exc:
                first = first or exc
        self._kept = []
        if first is not None:
            raise first


class CopyEngine(ABC):
    """Moves bytes between host buffers and one kind of tensor (see the module
    docstring). ``stats`` is advisory under concurrency: the tests read it from one
    thread."""

    name = ""

    def __init__(self) -> None:
        self.stats = {"batches": 0, "copies": 0, "syncs": 0, "waits": 0}

    @abstractmethod
    def claims(self, value: Any) -> bool:
        """Whether ``value`` (an output or a value to put) is this engine's to move."""

    @abstractmethod
    def begin(self, device: Any, *, after_caller: bool = True, after_slab: bool = False) -> Batch:
        """A new batch on ``device``, ordered after the work queued so far on the
        caller's current stream (a copy of the caller's tensor) and/or on the engine's
        ordered stream (a copy of slab bytes written by :meth:`write`)."""

    @abstractmethod
    def staging(self, n: int) -> Staged:
        """A page-locked host buffer of at least ``n`` bytes, valid until dropped."""

    @abstractmethod
    def slab(self, nbytes: int, device: Any) -> Any:
        """A fresh flat uint8 tensor of ``nbytes`` on ``device``."""

    @abstractmethod
    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        """Copy ``src`` into the slab view ``dst`` on the ordered stream, after the work
        the caller's stream has queued; returns without waiting. A device ``src`` is
        kept alive for the copy (the allocator does not hand it out under it);
        ``host_src`` (pageable host memory) returns once the source was consumed."""

    @abstractmethod
    def read(self, dst: Any, src: Any) -> None:
        """Copy the slab view ``src`` into the caller's device tensor ``dst`` on the
        ordered stream, after the caller's queued work; the caller's stream is ordered
        after the copy, so what it runs next sees the bytes. No host wait."""

    @staticmethod
    def flat(value: Any) -> Any:
        """A tensor's bytes as a flat uint8 tensor (no copy)."""
        import torch

        return value.reshape(-1).view(torch.uint8)
