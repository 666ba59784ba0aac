"""Host memory registered with CUDA: one table per process of the ranges made
page-locked, so device copies DMA straight out of (and into) them.

Why: a copy between a CUDA tensor and pageable memory is staged by the driver through
its own pinned buffer, one chunk at a time, and blocks the host; from registered memory
it is one asynchronous DMA. The ranges a process registers: the node's DRAM slab (the
server's mapping of its segment, kvstore/tiers/memory.py) and a client's mapping of a
node's segment (kvstore/client/device/side.py). vLLM's offloading connector registers
its shared region in every process the same way
(vllm/v1/kv_offload/cpu/shared_offload_region.py).

The rules, all enforced here, for every range of the process (a process that holds a
node and a client holds both kinds in the one :func:`process_registry`):

- **Once per process per range.** A range (its address and size in this process) is
  registered by the first user that needs it; later ones share it (a count), and the
  last release unregisters it. Each process that maps a segment registers its own
  mapping: registration is of virtual addresses, so the server's registration of its
  own mapping does nothing for a client.
- **Never one range twice.** A range that overlaps another registration is refused here
  before the driver sees it: the driver reports a second registration
  (``cudaErrorHostMemoryAlreadyRegistered``) as the thread's *last error*, which the
  next unrelated call that checks it (a kernel launch) reports as its own, far from the
  cause. After any failed call the registry clears that last error (``clear``).
- **Bounded chunks.** At most :data:`MAX_CHUNK` (64 GiB) per cudaHostRegister call: very
  large single registrations fail or stall on some drivers. A copy never crosses a chunk
  boundary when it is cut by :meth:`Registration.pieces`.
- **Every return code checked.** A failed chunk unregisters the chunks before it, the
  range is marked unregistrable (never retried: the failure would repeat), and callers
  fall back to pinned staging (staging.py, landing.py). The first failure in the
  process is logged as a warning naming the range's owner, later ones at debug level.

``cudart`` is injectable (anything with ``cudaHostRegister(ptr, size, flags)`` and
``cudaHostUnregister(ptr)`` returning an int-like code, 0 for success): the process
registry uses ``torch.cuda.cudart()``; the hermetic tests pass their own.

Concurrency: ``_lock`` guards ``_live`` and ``_warned``; the CUDA calls run under it (a
registration is made once per range, never on a copy's path).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "MAX_CHUNK",
    "Cudart",
    "HostRegistry",
    "Registration",
    "clear_last_error",
    "process_registry",
]

log = logging.getLogger(__name__)

MAX_CHUNK = 64 << 30
"""The most bytes one cudaHostRegister call covers."""

REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


class Cudart(Protocol):
    """The two runtime calls the registry makes (``torch.cuda.cudart()`` has them)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, ptr: int) -> Any: ...


class Registration:
    """One range's registration: ``pinned`` when every chunk of it is registered
    (copies DMA from it), else the caller stages through pinned buffers."""

    __slots__ = ("base", "chunk", "chunks", "pinned", "refs", "size", "what")

    def __init__(self, base: int, size: int, chunk: int, what: str) -> None:
        self.base = base
        self.size = size
        self.chunk = chunk
        self.what = what
        self.chunks: list[tuple[int, int]] = []  # (address, bytes) registered so far
        self.pinned = False
        self.refs = 1

    def covers(self, addr: int, n: int) -> bool:
        """Whether ``[addr, addr + n)`` lies inside this range."""
        return self.base <= addr and addr + n <= self.base + self.size

    def pieces(self, addr: int, n: int) -> list[tuple[int, int]]:
        """``[addr, addr + n)`` as ``(start, end)`` offsets relative to ``addr``, split
        where it crosses a chunk boundary (one piece for all but the rare straddler)."""
        first = (addr - self.base) // self.chunk
        last = (addr + n - 1 - self.base) // self.chunk
        if first == last:
            return [(0, n)]
        out, at = [], 0
        for c in range(first, last + 1):
            end = min(self.base + (c + 1) * self.chunk - addr, n)
            out.append((at, end))
            at = end
        return out


class HostRegistry:
    """The registrations of one process (see the module docstring for the rules).
    ``clear``: resets the runtime's last error after a failed call (None: the runtime
    keeps none, as a test's does)."""

    def __init__(
        self,
        cudart: Callable[[], Cudart],
        chunk: int = MAX_CHUNK,
        clear: Callable[[], None] | None = None,
    ) -> None:
        if chunk <= 0 or chunk > MAX_CHUNK:
            raise ValueError(f"chunk must be in (0, {MAX_CHUNK}], got {chunk}")
        self._cudart = cudart
        self.chunk = chunk
        self._clear = clear
        self._lock = threading.Lock()
        self._live: dict[tuple[int, int], Registration] = {}  # (base, size) -> registration
        self._warned = False

    def register(self, base: int, size: int, what: str = "host memory") -> Registration:
        """The registration of the range ``[base, base + size)``, made on first use;
        ``what`` names its owner in the log. Check ``pinned``: False means copies must
        stage (it failed, or the range overlaps another registered range)."""
        with self._lock:
            reg = self._live.get((base, size))
            if reg is not None:
                reg.refs += 1
                return reg
            reg = Registration(base, size, self.chunk, what)
            self._live[(base, size)] = reg
            clash = next(
                (r for r in self._live.values() if r.pinned and _overlap(r, base, size)),
                None,
            )
            if clash is not None:
                self._failed(reg, f"overlaps {clash.what} registered at {clash.base:#x}")
            else:
                self._pin(reg)
            return reg

    def release(self, reg: Registration) -> None:
        """Drop one use of ``reg``; the last unregisters it (call it before the range is
        unmapped, and only once no copy from it is in flight)."""
        with self._lock:
            reg.refs -= 1
            if reg.refs > 0 or self._live.get((reg.base, reg.size)) is not reg:
                return
            del self._live[(reg.base, reg.size)]
            self._unpin(reg)

    def live(self) -> int:
        """How many ranges are registered (or known unregistrable) now."""
        with self._lock:
            return len(self._live)

    def _pin(self, reg: Registration) -> None:
        try:
            rt = self._cudart()
        except Exception as exc:  # no CUDA runtime here: stage instead
            self._failed(reg, f"no CUDA runtime ({exc})")
            return
        at = reg.base
        end = reg.base + reg.size
        while at < end:
            n = min(self.chunk, end - at)
            try:
                err: Any = rt.cudaHostRegister(at, n, REGISTER_PORTABLE)
                rc = int(err)
            except Exception as exc:  # a binding that raises instead of returning
                rc, err = -1, exc
            if rc != 0:
                why = _error_name(rt, err)
                self._cleared()
                self._unpin(reg)
                self._failed(reg, f"cudaHostRegister({at:#x}, {n}) failed: {why}")
                return
            reg.chunks.append((at, n))
            at += n
        reg.pinned = True

    def _unpin(self, reg: Registration) -> None:
        if not reg.chunks:
            return
        rt = self._cudart()
        for at, n in reg.chunks:
            try:
                err: Any = rt.cudaHostUnregister(at)
                rc = int(err)
            except Exception as exc:  # a binding that raises instead of returning
                rc, err = -1, exc
            if rc != 0:
                self._cleared()
                why = _error_name(rt, err)
                log.warning("cudaHostUnregister(%#x) of %d bytes failed: %s", at, n, why)
        reg.chunks = []
        reg.pinned = False

    def _cleared(self) -> None:
        if self._clear is not None:
            self._clear()

    def _failed(self, reg: Registration, why: str) -> None:
        reg.pinned = False
        if self._warned:
            log.debug("%s not registered with CUDA (%s); staging", reg.what, why)
            return
        self._warned = True
        log.warning(
            "%s could not be registered with CUDA (%s): copies between it and CUDA "
            "tensors go through pinned staging (said once per process)",
            reg.what,
            why,
        )


def _overlap(reg: Registration, base: int, size: int) -> bool:
    return reg.base < base + size and base < reg.base + reg.size


def _error_name(rt: Any, err: Any) -> str:
    if isinstance(err, Exception):
        return f"raised {err}"
    try:
        return f"{rt.cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # a runtime (or an error value) the binding cannot name
        return f"error {int(err)}"


def clear_last_error() -> None:
    """Reset CUDA's last error after a failed call, so it is not reported later by an
    unrelated one: through the libcudart torch loaded (found in this process's maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart" in ln and "/" in ln}
    except OSError:
        paths = set()
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except OSError:
            continue


_PROCESS: HostRegistry | None = None
_PROCESS_LOCK = threading.Lock()


def _torch_cudart() -> Cudart:
    import torch

    return torch.cuda.cudart()


def process_registry() -> HostRegistry:
    """The registry of this process (registrations are per process by nature)."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = HostRegistry(_torch_cudart, clear=clear_last_error)
        return _PROCESS
