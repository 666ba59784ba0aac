"""Prefault a mapping of a shared segment, in the background, so that copies into it run
at memory speed from the first one.

Each process has its own page tables. A client that maps a node's DRAM segment starts
with none: its first write to each 4 KiB page takes a minor fault, about 1.5 us here,
so 1 MiB copies into extents this process never touched ran at 3.1 GB/s against 16.8
prefaulted on this project's 2-core hosts (benchmarks/bench_prefault.py). Puts land in
fresh extents all over the segment, so without this every same-host put pays the
faults.

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) fills the page tables without changing a
byte. It runs on a daemon thread through ctypes, which releases the GIL, in chunks, so
the client's own calls go on meanwhile and :meth:`Prefaulter.stop` returns within one
chunk. Page tables cost 2 MiB of this process's memory per GiB populated; ``limit``
bounds it (the first ``limit`` bytes are populated, the rest faults in on use).
Where the kernel lacks the call the mapping simply faults on use, as before.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

__all__ = ["MADV_POPULATE_WRITE", "Prefaulter"]

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
_CHUNK = 32 << 20  # ~2 ms of work: how long stop() may wait

_libc: ctypes.CDLL | None = None


def _madvise() -> Any:
    """libc's madvise, looked up in this process's own symbols (no ldconfig run)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    fn = getattr(_libc, "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """Populates ``[address, address + size)`` of this process's mapping on a thread.

    The owner must keep the mapping alive until :meth:`stop` has returned.
    """

    def __init__(self, address: int, size: int, *, limit: int) -> None:
        self.address = address
        self.size = min(size, max(limit, 0))
        self.populated = 0  # bytes done so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.size > 0 and address:
            self._thread = threading.Thread(target=self._run, name="kvstore-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        fn = _madvise()
        if fn is None:
            return
        page = 4096
        start = self.address - self.address % page
        end = self.address + self.size
        at = start
        while at < end and not self._stop.is_set():
            n = min(_CHUNK, end - at)
            if fn(at, n, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                log.debug("prefault stopped at +%d: errno %d", at - start, err)
                return
            at += n
            self.populated = at - start

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the population to end; True when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop populating and wait for the thread (one chunk at most): after this the
        mapping may be closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
