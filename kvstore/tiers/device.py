"""The copy-engine seam: how a tier's bytes move between a device and host memory.

Every copy a tier makes to or from a device goes through a :class:`CopyEngine`, so
the decisions around the copies (which stream orders after which, when the host
waits, how a landing is cut into pieces and hashed while the rest is in flight) are
one piece of code whatever the device:

- :class:`CudaEngine` runs them on CUDA streams. Two per device: the *tier stream*
  carries every asynchronous copy into or out of an HBM slab (a put's D2D, a get's
  D2D), so a slab extent's reads and writes are ordered by submission, and a place
  freed after a read was enqueued cannot be rewritten under it. A copy on it waits
  for the caller's stream first (the producer's work, or the reader's use of its
  buffer), and the caller's stream then waits for the copy, both by events, so what
  the caller queues next sees the copy done; the host never waits. The *side stream*
  carries the copies the host does wait on (D2H departures, H2D arrivals), ordered
  after the caller's stream (a copy of the caller's tensor) or the tier stream (a
  copy of slab bytes) by events, never by a device-wide synchronization.
- :class:`HostEngine` runs the same calls on CPU tensors, synchronously: the HBM
  tier's bookkeeping and the DRAM tier's device paths then run, and are tested, on a
  machine without CUDA (``NodeConfig.hbm_device = "cpu"``).

:func:`land_hashed` is the departure every block makes when it leaves a device:
copied to host memory in pieces, each piece hashed on the host as soon as its copy
has landed while the later ones are still in flight, so hashing costs about one
piece more than the copy itself (xxh3 fed piece by piece equals xxh3 of the whole).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from kvstore.blocks import checksum_stream

__all__ = [
    "CopyEngine",
    "CudaEngine",
    "Fence",
    "HostEngine",
    "engine_for",
    "land_hashed",
    "lift",
    "pieces",
]

_MIN_PIECE = 256 << 10  # below this a piece's event costs more than the overlap wins
_MAX_PIECES = 8


def pieces(n: int) -> list[tuple[int, int]]:
    """How a landing of ``n`` bytes is cut: at most 8 spans of at least 256 KiB (one
    span below 512 KiB), each a multiple of 4 KiB but the last."""
    if n <= 2 * _MIN_PIECE:
        return [(0, n)]
    size = max(_MIN_PIECE, -(-n // _MAX_PIECES))
    size = -(-size // 4096) * 4096
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class Fence(ABC):
    """The end of some copies enqueued on a stream: the host may wait for it."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the copies before the fence are done."""


class _Done(Fence):
    __slots__ = ()

    def wait(self) -> None:
        return None


_DONE = _Done()


class CopyEngine(ABC):
    """Copies between one device's memory and the host (or within the device)."""

    device: Any  # torch.device

    @abstractmethod
    def slab(self, nbytes: int) -> Any:
        """A fresh uint8 tensor of ``nbytes`` on the device."""

    @abstractmethod
    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        """Copy ``src`` into the slab view ``dst`` on the tier stream, after the work
        the caller's stream has queued; returns without waiting. A device ``src`` is
        kept alive for the copy (the allocator does not hand it out under it);
        ``host_src`` (pageable host memory) returns once the source was consumed."""

    @abstractmethod
    def read(self, dst: Any, src: Any) -> None:
        """Copy the slab view ``src`` into the caller's device tensor ``dst`` on the
        tier stream, after the caller's queued work; the caller's stream is ordered
        after the copy, so what it runs next sees the bytes. No host wait."""

    @abstractmethod
    def order(self, *, caller: bool = True, tier: bool = False) -> None:
        """Order the side stream after the caller's current stream (a copy of the
        caller's tensor) and/or the tier stream (a copy of slab bytes): do once before
        a batch of side-stream copies."""

    @abstractmethod
    def to_host(self, dst: Any, src: Any) -> Fence:
        """Enqueue a D2H copy of ``src`` into the host tensor ``dst`` on the side
        stream; the returned fence says when it landed."""

    @abstractmethod
    def to_device(self, dst: Any, src: Any) -> Fence:
        """Enqueue an H2D copy of the host tensor ``src`` into ``dst`` on the side
        stream; the returned fence says when it landed."""

    @abstractmethod
    def staging(self, nbytes: int) -> Any:
        """A host uint8 tensor of ``nbytes`` the engine copies to and from at full
        speed (pinned under CUDA), valid until the caller drops it."""


class CudaEngine(CopyEngine):
    """Copies on one CUDA device's tier and side streams (see the module docstring)."""

    def __init__(self, device: Any) -> None:
        import torch

        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._torch = torch
        self._tier = torch.cuda.Stream(dev)
        self._side = torch.cuda.Stream(dev)

    def slab(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def _current(self, t: Any) -> Any:
        dev = t.device if t.device.type == "cuda" else self.device
        return self._torch.cuda.current_stream(dev)

    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        torch, tier = self._torch, self._tier
        producer = self._current(src)
        tier.wait_stream(producer)
        with torch.cuda.stream(tier):
            dst.copy_(src, non_blocking=not host_src)
        if host_src:
            return
        # What the producer queues next (an in-place update of src, a reuse of its
        # memory) runs after the copy read it: a wait on the device, not the host.
        producer.wait_stream(tier)
        if src.device == self.device:
            src.record_stream(tier)  # and a free from another stream waits for it too

    def read(self, dst: Any, src: Any) -> None:
        torch, tier = self._torch, self._tier
        caller = self._current(dst)
        tier.wait_stream(caller)  # dst may still be read by the caller's queued work
        with torch.cuda.stream(tier):
            dst.copy_(src, non_blocking=True)
        caller.wait_stream(tier)

    def order(self, *, caller: bool = True, tier: bool = False) -> None:
        side = self._side
        if caller:
            side.wait_stream(self._torch.cuda.current_stream(self.device))
        if tier:
            side.wait_stream(self._tier)

    def to_host(self, dst: Any, src: Any) -> Fence:
        with self._torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)
        return self._fence()

    def to_device(self, dst: Any, src: Any) -> Fence:
        with self._torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)
        return self._fence()

    def _fence(self) -> Fence:
        ev = self._torch.cuda.Event()
        ev.record(self._side)
        return _CudaFence(ev)

    def staging(self, nbytes: int) -> Any:
        # torch's caching host allocator: pinned, reused after its copies' events
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)


class _CudaFence(Fence):
    __slots__ = ("_ev",)

    def __init__(self, ev: Any) -> None:
        self._ev = ev

    def wait(self) -> None:
        self._ev.synchronize()


class HostEngine(CopyEngine):
    """The engine's calls on CPU tensors, each done when it returns."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.device = torch.device("cpu")

    def slab(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        dst.copy_(src)

    def read(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def order(self, *, caller: bool = True, tier: bool = False) -> None:
        return None

    def to_host(self, dst: Any, src: Any) -> Fence:
        dst.copy_(src)
        return _DONE

    def to_device(self, dst: Any, src: Any) -> Fence:
        dst.copy_(src)
        return _DONE

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)


def engine_for(device: Any) -> CopyEngine:
    """A new engine for ``device``: CUDA streams for a CUDA device, else the host's."""
    import torch

    dev = torch.device(device)
    return CudaEngine(dev) if dev.type == "cuda" else HostEngine()


def land_hashed(engine: CopyEngine, src: Any, dst: np.ndarray, *, pinned: bool) -> int:
    """Copy the flat uint8 device tensor ``src`` into the host array ``dst`` and return
    the xxh3 of what landed, hashing each piece while the later ones copy.

    ``pinned``: ``dst`` is page-locked (registered) memory the device writes at full
    speed, so every piece goes straight into it; otherwise each goes through one of
    two pinned staging buffers in turn and is copied into ``dst`` after it is hashed.
    The caller orders the engine's side stream first (:meth:`CopyEngine.order`).
    """
    import torch

    spans = pieces(int(dst.nbytes))
    h = checksum_stream()
    if pinned:
        out = torch.from_numpy(dst)
        fences = [engine.to_host(out[a:b], src[a:b]) for a, b in spans]
        for (a, b), fence in zip(spans, fences, strict=True):
            fence.wait()
            h.update(dst[a:b])
        return int(h.intdigest())
    width = spans[0][1] - spans[0][0]
    stages = [engine.staging(width) for _ in range(min(2, len(spans)))]
    views = [s.numpy() for s in stages]
    inflight: list[Fence] = []
    for i, (a, b) in enumerate(spans[: len(stages)]):
        inflight.append(engine.to_host(stages[i][: b - a], src[a:b]))
    for i, (a, b) in enumerate(spans):
        slot = i % len(stages)
        inflight[i].wait()
        piece = views[slot][: b - a]
        h.update(piece)
        np.copyto(dst[a:b], piece)
        nxt = i + len(stages)
        if nxt < len(spans):  # the stage is free again: its bytes are in dst
            na, nb = spans[nxt]
            inflight.append(engine.to_host(stages[slot][: nb - na], src[na:nb]))
    return int(h.intdigest())


def lift(engine: CopyEngine, src: np.ndarray, dst: Any, *, pinned: bool) -> None:
    """Copy the host array ``src`` into the caller's flat uint8 device tensor ``dst``
    as one H2D on the side stream, ordered after the caller's stream, and wait for it
    (the caller's bytes may be freed once this returns). ``pinned``: ``src`` is
    page-locked and copied from as it is; otherwise it is staged once into pinned
    memory first."""
    import torch

    engine.order(caller=True)
    if pinned:
        host = torch.from_numpy(src)
    else:
        host = engine.staging(int(src.nbytes))
        np.copyto(host.numpy(), src)
    engine.to_device(dst, host).wait()
