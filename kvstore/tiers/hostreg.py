"""Page-locking host memory for CUDA copies: cudaHostRegister in chunks, once a range.

DESIGN.md "GPU": a process that copies between CUDA tensors and the node's DRAM slab
registers that mapping with CUDA once, so the DMA engine reads and writes it straight
(no bounce through the driver's pinned staging), in chunks of at most 64 GiB, every
return code checked, never twice for one range. Registering an overlapping range
again fails with an error CUDA keeps as the thread's *last error* and that the next
unrelated call which checks it (a kernel launch) reports as its own, far from the
cause; so this module keeps the ranges it registered and refuses an overlap itself,
and after any failed call clears that last error. A failure unregisters the chunks
done and returns False: the caller falls back to pinned staging copies and says so
once in the log.

Concurrency: one lock over the process's table of registered ranges.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

__all__ = ["CHUNK", "register", "registered", "unregister"]

log = logging.getLogger(__name__)

CHUNK = 64 << 30  # the largest single cudaHostRegister call
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process

_lock = threading.Lock()
_ranges: dict[int, list[tuple[int, int]]] = {}  # start -> the chunks (ptr, len) registered


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


def _overlaps(start: int, nbytes: int) -> bool:
    for s, chunks in _ranges.items():
        end = s + sum(n for _, n in chunks)
        if start < end and s < start + nbytes:
            return True
    return False


def _clear_last_error() -> None:
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


def register(ptr: int, nbytes: int, what: str = "host memory") -> bool:
    """Page-lock ``[ptr, ptr + nbytes)`` for CUDA in chunks of at most :data:`CHUNK`.

    True when every chunk registered (or this exact range was already registered by
    this module); False, with one warning naming ``what`` and CUDA's error, when a
    chunk failed (the chunks done are unregistered) or the range overlaps one
    registered before: the caller copies through pinned staging instead."""
    with _lock:
        got = _ranges.get(ptr)
        if got is not None and sum(n for _, n in got) == nbytes:
            return True
        if _overlaps(ptr, nbytes):
            log.warning(
                "%s: not registered with CUDA (overlaps a registered range); "
                "copies go through pinned staging",
                what,
            )
            return False
        rt = _cudart()
        done: list[tuple[int, int]] = []
        for off in range(0, nbytes, CHUNK):
            n = min(CHUNK, nbytes - off)
            err = rt.cudaHostRegister(ptr + off, n, _PORTABLE)
            if int(err) != 0:
                _clear_last_error()
                for p, _n in done:
                    if int(rt.cudaHostUnregister(p)) != 0:
                        _clear_last_error()
                log.warning(
                    "%s: cudaHostRegister of %d bytes at +%d failed (%s); copies go "
                    "through pinned staging",
                    what,
                    n,
                    off,
                    _error_name(rt, err),
                )
                return False
            done.append((ptr + off, n))
        _ranges[ptr] = done
        return True


def registered(ptr: int) -> bool:
    """Whether a range starting at ``ptr`` is registered by this module."""
    with _lock:
        return ptr in _ranges


def unregister(ptr: int) -> None:
    """Unregister the range :func:`register` registered at ``ptr`` (nothing if none);
    a failing chunk is logged, the others still go."""
    with _lock:
        chunks = _ranges.pop(ptr, None)
        if not chunks:
            return
        rt = _cudart()
        for p, n in chunks:
            err = rt.cudaHostUnregister(p)
            if int(err) != 0:
                _clear_last_error()
                log.warning("cudaHostUnregister of %d bytes failed (%s)", n, _error_name(rt, err))


def _error_name(rt: Any, err: Any) -> str:
    try:
        return f"{rt.cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # an error value the binding cannot name
        return f"cudaError {int(err)}"
