"""The SSD tier's data file: page-aligned extents and the bytes moved through them.

Split from disk.py so the index (lmdb, records, pins) and the byte mover stay apart:
``_Extents`` knows free space and nothing of keys, ``_Slab`` moves bytes with
O_DIRECT where the filesystem allows and knows nothing of space. Both are guarded
by DiskTier's lock (extents) or need none (slab I/O runs on owned or pinned extents).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.blocks import HEADER_SIZE
from kvstore.errors import ConfigError, CorruptBlock

__all__ = ["PAGE", "extent_len"]

PAGE = 4096  # allocation unit and O_DIRECT alignment (>= any device's logical block)
_MIB = 1 << 20
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def extent_len(payload_len: int) -> int:
    """Bytes a block with this payload occupies in the slab: header page + padded payload."""
    return PAGE + -(-payload_len // PAGE) * PAGE


class _Extents:
    """Free space of the slab as page-aligned extents; guarded by DiskTier's lock.

    A store's blocks are nearly all one size, so an exact-size free set serves almost
    every allocation in O(1); else bump the high-water mark, and only then first-fit.
    Freed neighbours coalesce and free space touching the high-water mark lowers it, so
    mixed sizes do not fragment the slab for good.
    """

    __slots__ = ("_by_end", "_by_len", "_by_start", "size", "top")

    def __init__(self, size: int) -> None:
        self.size, self.top = size, 0
        self._by_start: dict[int, int] = {}  # free extent start -> length
        self._by_end: dict[int, int] = {}  # free extent end -> start
        self._by_len: dict[int, set[int]] = {}  # length -> starts

    def rebuild(self, used: list[tuple[int, int]]) -> None:
        """Derive free space from the extents in use (sorted by offset, disjoint)."""
        pos = 0
        for start, length in used:
            if start > pos:
                self._insert(pos, start - pos)
            pos = start + length
        self.top = pos

    def alloc(self, n: int) -> int | None:
        """Offset of a fresh extent of ``n`` bytes, or None if no free run is that long."""
        if self._by_len.get(n):
            start = self._by_len[n].pop()  # amortized O(1), unlike next(iter(...))
            self._by_len[n].add(start)  # back, for _remove to take out of all three maps
            self._remove(start, n)
            return start
        if self.top + n <= self.size:
            start, self.top = self.top, self.top + n
            return start
        for start, length in self._by_start.items():
            if length >= n:
                self._remove(start, length)
                if length > n:
                    self._insert(start + n, length - n)
                return start
        return None

    def can_alloc(self, n: int) -> bool:
        """Whether :meth:`alloc` of ``n`` would succeed now."""
        if self._by_len.get(n) or self.top + n <= self.size:
            return True
        return any(length >= n for length in self._by_start.values())

    def free(self, start: int, n: int) -> None:
        """Return an extent, merging it with free neighbours."""
        prev = self._by_end.get(start)
        if prev is not None:
            plen = self._by_start[prev]
            self._remove(prev, plen)
            start, n = prev, n + plen
        nlen = self._by_start.get(start + n)
        if nlen is not None:
            self._remove(start + n, nlen)
            n += nlen
        if start + n == self.top:
            self.top = start
        else:
            self._insert(start, n)

    def _insert(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._by_len.setdefault(n, set()).add(start)

    def _remove(self, start: int, n: int) -> None:
        del self._by_start[start]
        del self._by_end[start + n]
        starts = self._by_len[n]
        starts.discard(start)
        if not starts:
            del self._by_len[n]


class _Slab:
    """The data file and the bytes moved through it; knows nothing of keys or space.

    O_DIRECT where the filesystem takes it (tmpfs refuses with EINVAL), else buffered.
    Direct I/O needs page-aligned memory and lengths: aligned caller buffers are used as
    they are, anything else goes through this thread's mmap-allocated staging buffer.
    """

    def __init__(self, path: Path, size: int) -> None:
        self._local = threading.local()
        self.direct = False
        self.fd = os.open(path, _FLAGS, 0o600)
        try:
            self._size_to(size)
            if _O_DIRECT:
                self._go_direct(path)
        except BaseException:
            os.close(self.fd)
            raise

    def _size_to(self, size: int) -> None:
        """Check the filesystem has room for ``size``; cut the file if it is longer.

        Neither preallocated nor sized up front: ext4 turns direct writes into fallocated
        space or holes below EOF into unwritten extents converted at completion, which
        measured 30-50% slower on first fill than appending. The allocator bumps upward,
        so a fresh slab grows by appends. A disk filled by others later fails writes
        with StorageError.
        """
        st, vfs = os.fstat(self.fd), os.fstatvfs(self.fd)
        if size - st.st_blocks * 512 > vfs.f_bavail * vfs.f_frsize:
            raise ConfigError(f"SSD tier of {size} bytes: only {vfs.f_bavail * vfs.f_frsize} free")
        if st.st_size > size:
            os.ftruncate(self.fd, size)

    def _go_direct(self, path: Path) -> None:
        """Swap to an O_DIRECT descriptor if one opens and reads a page; else stay buffered."""
        try:
            fd = os.open(path, _FLAGS | _O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return
            raise
        try:
            probe: list[Any] = [self.staging(PAGE)[:PAGE]]
            os.preadv(fd, probe, 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.EINVAL:
                return
            raise
        os.close(self.fd)
        self.fd, self.direct = fd, True

    def staging(self, n: int) -> np.ndarray:
        """This thread's page-aligned scratch buffer of at least ``n`` bytes, touched once."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = np.frombuffer(mmap.mmap(-1, -(-n // _MIB) * _MIB), dtype=np.uint8)
            buf.fill(0)
            self._local.buf = buf
        return buf

    def _as_is(self, buf: np.ndarray) -> bool:
        return not self.direct or (int(buf.ctypes.data) % PAGE == 0 and buf.nbytes % PAGE == 0)

    def write(self, offset: int, raw: bytes, payload: np.ndarray) -> None:
        """Write one record, header page then payload, at ``offset``."""
        n = payload.nbytes
        size = PAGE if self._as_is(payload) else extent_len(n)
        buf = self.staging(size)[:size]
        buf[:HEADER_SIZE] = np.frombuffer(raw, dtype=np.uint8)
        buf[HEADER_SIZE:PAGE] = 0
        bufs: list[Any] = [buf, payload]
        if size > PAGE:  # staged: copy, zero the padding, one buffer
            buf[PAGE : PAGE + n] = payload
            buf[PAGE + n :] = 0
            bufs.pop()
        if os.pwritev(self.fd, bufs, offset) != sum(b.nbytes for b in bufs):
            raise OSError(errno.ENOSPC, "short write to the slab")  # a full disk, in practice

    def read(self, offset: int, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read a header page and ``out.nbytes`` of payload: (page, payload). The payload
        lands in ``out`` when it can go there directly, else in staging (caller copies)."""
        n = out.nbytes
        if self._as_is(out):
            bufs: list[Any] = [self.staging(PAGE)[:PAGE], out]
        else:
            bufs = [self.staging(extent_len(n))[: extent_len(n)]]
        got = os.preadv(self.fd, bufs, offset)
        if got < PAGE + n:
            raise CorruptBlock(f"slab holds {got} of {PAGE + n} bytes at offset {offset}")
        return bufs[0][:PAGE], (out if len(bufs) == 2 else bufs[0][PAGE : PAGE + n])
