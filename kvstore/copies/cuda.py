"""The copy engine on CUDA streams (the seam: engine.py).

Per device, two kinds of stream:

- **side streams**, pooled: a batch takes one at :meth:`CudaCopyEngine.begin` and gives
  it back at :meth:`~kvstore.copies.engine.Batch.finish`, so batches of different
  threads (a node's request threads and its background hasher, a client's calls) never
  queue behind each other. A batch waits, by an event, for the caller's current stream
  and/or the device's ordered stream, as ``begin`` is told; its copies are
  ``Tensor.copy_(non_blocking=True)`` issued as one ``torch._foreach_copy_`` call per
  submission (the per-block loop runs in C++, not Python);
- **the ordered stream**, one: every :meth:`CudaCopyEngine.write` and
  :meth:`CudaCopyEngine.read` of slab bytes, in submission order.

Staging buffers are pinned tensors from torch's caching host allocator, which records
the copies' streams, so a freed buffer is reused only after its copy. CUDA failures
(RuntimeError and its torch subclasses) become :class:`~kvstore.errors.DeviceError`
here and nowhere else.

Thread-safe: ``_lock`` guards the stream pool and the making of an ordered stream (read
without it once made: never replaced); a batch belongs to the one thread that began it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.copies.engine import Batch, Completion, CopyEngine, Staged, is_cuda
from kvstore.errors import DeviceError

__all__ = ["CudaCopyEngine", "engine_for", "process_engine"]


@contextlib.contextmanager
def _cuda_errors(what: str) -> Iterator[None]:
    """The one place CUDA failures (RuntimeError and its torch subclasses) are mapped."""
    try:
        yield
    except RuntimeError as exc:
        raise DeviceError(f"{what}: {exc}") from exc


class _CudaCompletion(Completion):
    __slots__ = ("engine", "event")

    def __init__(self, engine: CopyEngine, event: Any) -> None:
        self.engine = engine
        self.event = event

    def wait(self) -> None:
        with _cuda_errors("waiting for device copies"):
            if not self.event.query():
                self.engine.stats["waits"] += 1
                self.event.synchronize()


class _CudaBatch(Batch):
    """One batch's copies on its side stream. Each submission that may touch slab bytes
    (every D2D; every copy of a batch begun ``after_slab``) first waits, on the device,
    for the ordered stream as it is then: another thread's ordered write committed after
    this batch began (a block this call then found) lands before this batch reads it,
    and an ordered read of a place lands before this batch writes over it."""

    def __init__(
        self, engine: CudaCopyEngine, stream: Any, device: int, *, after_slab: bool
    ) -> None:
        super().__init__(engine)
        self.stream = stream
        self.device = device
        self.after_slab = after_slab
        self._torch = engine._torch

    def _copy(self, dsts: Sequence[Any], srcs: Sequence[Any], *, slab: bool = False) -> None:
        torch = self._torch
        if slab or self.after_slab:
            assert isinstance(self.engine, CudaCopyEngine)
            with _cuda_errors("ordering device copies"):
                self.stream.wait_stream(self.engine._ordered_stream(self.device))
        with _cuda_errors("queueing device copies"), torch.cuda.stream(self.stream):
            if len(dsts) == 1:
                dsts[0].copy_(srcs[0], non_blocking=True)
            else:
                torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        self.engine.stats["copies"] += len(dsts)

    def h2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._copy(dsts, [self._host(s) for s in srcs])

    def d2h(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._copy([self._host(d) for d in dsts], srcs)

    def d2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self._copy(dsts, srcs, slab=True)

    def _host(self, buf: Any) -> Any:
        return self._torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf

    def mark(self) -> Completion:
        with _cuda_errors("recording a copy event"):
            event = self._torch.cuda.Event()
            event.record(self.stream)
        return _CudaCompletion(self.engine, event)

    def _release(self) -> None:
        assert isinstance(self.engine, CudaCopyEngine)
        self.engine._give_stream(self.device, self.stream)


class CudaCopyEngine(CopyEngine):
    """Copies on pooled side streams and one ordered stream per device (see the module
    docstring)."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        import torch

        self._torch = torch
        self._lock = threading.Lock()
        self._streams: dict[int, list[Any]] = {}  # device index -> idle side streams
        self._ordered: dict[int, Any] = {}  # device index -> its ordered stream

    def claims(self, value: Any) -> bool:
        return is_cuda(value)

    def _index(self, device: Any) -> int:
        index = self._torch.device(device).index
        return self._torch.cuda.current_device() if index is None else int(index)

    def begin(self, device: Any, *, after_caller: bool = True, after_slab: bool = False) -> Batch:
        torch = self._torch
        index = self._index(device)
        with _cuda_errors("starting a copy batch"):
            stream = self._take_stream(index)
            if after_caller:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(index))
                stream.wait_event(ready)  # after the producer's work, without a host wait
        self.stats["batches"] += 1
        return _CudaBatch(self, stream, index, after_slab=after_slab)

    def staging(self, n: int) -> Staged:
        with _cuda_errors(f"allocating {n} bytes of pinned staging"):
            t = self._torch.empty(n, dtype=self._torch.uint8, pin_memory=True)
        return Staged(t.numpy(), t)

    def slab(self, nbytes: int, device: Any) -> Any:
        torch = self._torch
        with _cuda_errors(f"allocating {nbytes} bytes on {device}"):
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.device(device))

    def _current(self, t: Any, other: Any) -> Any:
        """The caller's current stream on ``t``'s device (``other``'s for a host ``t``)."""
        dev = t.device if t.device.type == "cuda" else other.device
        return self._torch.cuda.current_stream(dev)

    def write(self, dst: Any, src: Any, *, host_src: bool = False) -> None:
        torch = self._torch
        with _cuda_errors("queueing a device write"):
            ordered = self._ordered_stream(self._index(dst.device))
            producer = self._current(src, dst)
            ordered.wait_stream(producer)
            with torch.cuda.stream(ordered):
                dst.copy_(src, non_blocking=not host_src)
            if host_src:
                return
            # What the producer queues next (an in-place update of src, a reuse of its
            # memory) runs after the copy read it: a wait on the device, not the host.
            producer.wait_stream(ordered)
            if src.device == dst.device:
                src.record_stream(ordered)  # a free from another stream waits for it too

    def read(self, dst: Any, src: Any) -> None:
        torch = self._torch
        with _cuda_errors("queueing a device read"):
            ordered = self._ordered_stream(self._index(src.device))
            caller = self._current(dst, src)
            ordered.wait_stream(caller)  # dst may still be read by the caller's queued work
            with torch.cuda.stream(ordered):
                dst.copy_(src, non_blocking=True)
            caller.wait_stream(ordered)

    def _ordered_stream(self, index: int) -> Any:
        stream = self._ordered.get(index)  # made once per device, never replaced
        if stream is not None:
            return stream
        with self._lock:
            stream = self._ordered.get(index)
            if stream is None:
                stream = self._ordered[index] = self._torch.cuda.Stream(device=index)
            return stream

    def _take_stream(self, index: int) -> Any:
        with self._lock:
            idle = self._streams.get(index)
            if idle:
                return idle.pop()
        return self._torch.cuda.Stream(device=index)

    def _give_stream(self, index: int, stream: Any) -> None:
        with self._lock:
            self._streams.setdefault(index, []).append(stream)


_ENGINE: CudaCopyEngine | None = None
_ENGINE_LOCK = threading.Lock()


def process_engine() -> CudaCopyEngine:
    """The CUDA copy engine of this process (made on first use): the node's tiers and
    the client's transports in one process share its streams."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = CudaCopyEngine()
        return _ENGINE


def engine_for(device: Any) -> CopyEngine:
    """The engine that moves ``device``'s bytes: the process's CUDA engine for a CUDA
    device, else a new host engine (a tier over host memory, ``hbm_device="cpu"``)."""
    import torch

    from kvstore.copies.host import HostCopyEngine

    return process_engine() if torch.device(device).type == "cuda" else HostCopyEngine()
