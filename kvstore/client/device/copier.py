"""The copy engine: the seam between the transports' batching logic and the device.

A :class:`Batch` is one submission of copies on one stream: it is ordered after the
producer's (caller's) current stream by an event taken at :meth:`CopyEngine.begin`, its
copies are queued without waiting, :meth:`Batch.mark` records an event at a point of it
(what a staging slot or a put waits on), and :meth:`Batch.finish` waits once for the
whole batch. That is habit 18 of STYLE.md (vllm/v1/kv_offload/cpu/gpu_worker.py submits a
step's copies the same way; SGLang's cache_controller.py waits on one event per layer).
Never a device-wide synchronize: only this batch's stream is waited for.

Two implementations of the one seam:

- :class:`CudaCopyEngine`: a pooled side stream per device (taken per batch, given back
  after it), ``Tensor.copy_(non_blocking=True)`` issued as one ``torch._foreach_copy_``
  call per submission (the per-block loop runs in C++, not Python), events from
  ``torch.cuda.Event``. Its staging buffers are pinned tensors from torch's caching host
  allocator, which records the copies' streams, so a freed buffer is reused only after
  its copy. CUDA failures become :class:`~kvstore.errors.DeviceError` here and nowhere
  else.
- :class:`HostCopyEngine`: the same contract on CPU tensors and numpy arrays, so the
  batching, staging and ordering logic above it runs in CI. With ``deferred`` (the
  default) a copy runs only when an event after it is waited for, as a stream would run
  it later: code that read a destination before waiting, or checked a source's slot
  before its copy ran, sees the bug on CPU too.

Both count what the callers' contracts promise (``stats``): batches begun, copies queued,
host waits (one per batch, plus one per staging slot or put item that has to wait).
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.client.device import is_cuda
from kvstore.errors import DeviceError

__all__ = ["Batch", "Completion", "CopyEngine", "CudaCopyEngine", "HostCopyEngine", "Staged"]


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


class Batch(ABC):
    """Copies on one stream, ordered after the producer's stream."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self._done = False

    @abstractmethod
    def h2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Queue copies of host buffers ``srcs`` (page-locked: registered segment views
        or staging handles) into flat uint8 tensors ``dsts``."""

    @abstractmethod
    def d2h(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Queue copies of flat uint8 tensors ``srcs`` into host buffers ``dsts``."""

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

    def _release(self) -> None:  # noqa: B027 - a hook: nothing to give back on the host
        """Give the batch's stream back (nothing for the host engine)."""


class CopyEngine(ABC):
    """Moves bytes between host buffers and one kind of tensor."""

    name = ""

    def __init__(self) -> None:
        self.stats = {"batches": 0, "copies": 0, "syncs": 0, "waits": 0}

    @abstractmethod
    def claims(self, value: Any) -> bool:
        """Whether ``value`` (an output or a value to put) is this engine's to move."""

    @abstractmethod
    def begin(self, device: Any) -> Batch:
        """A new batch on ``device``, ordered after the work queued there so far."""

    @abstractmethod
    def staging(self, n: int) -> Staged:
        """A page-locked host buffer of at least ``n`` bytes."""

    @staticmethod
    def flat(value: Any) -> Any:
        """A tensor's bytes as a flat uint8 tensor (no copy)."""
        import torch

        return value.reshape(-1).view(torch.uint8)


# -- CUDA ------------------------------------------------------------------------------


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
    def __init__(self, engine: CudaCopyEngine, stream: Any, device: int) -> None:
        super().__init__(engine)
        self.stream = stream
        self.device = device
        self._torch = engine._torch

    def _copy(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        torch = self._torch
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
    """Copies on pooled side streams (one taken per batch). Thread-safe: ``_lock``
    guards the stream pool; a batch belongs to the one thread that began it."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        import torch

        self._torch = torch
        self._lock = threading.Lock()
        self._streams: dict[int, list[Any]] = {}  # device index -> idle side streams

    def claims(self, value: Any) -> bool:
        return is_cuda(value)

    def begin(self, device: Any) -> Batch:
        torch = self._torch
        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        with _cuda_errors("starting a copy batch"):
            stream = self._take_stream(index)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(index))
            stream.wait_event(ready)  # after the producer's work, without a host wait
        self.stats["batches"] += 1
        return _CudaBatch(self, stream, index)

    def staging(self, n: int) -> Staged:
        with _cuda_errors(f"allocating {n} bytes of pinned staging"):
            t = self._torch.empty(n, dtype=self._torch.uint8, pin_memory=True)
        return Staged(t.numpy(), t)

    def _take_stream(self, index: int) -> Any:
        with self._lock:
            idle = self._streams.get(index)
            if idle:
                return idle.pop()
        return self._torch.cuda.Stream(device=index)

    def _give_stream(self, index: int, stream: Any) -> None:
        with self._lock:
            self._streams.setdefault(index, []).append(stream)


# -- host ------------------------------------------------------------------------------


def _np(buf: Any) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


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

    def begin(self, device: Any) -> Batch:
        self.stats["batches"] += 1
        return _HostBatch(self)

    def staging(self, n: int) -> Staged:
        buf = np.empty(n, dtype=np.uint8)
        return Staged(buf, buf)
