"""The DRAM tier's published index: where each block sits in the shared segment, for
same-host readers to find and copy without asking the server.

Why: a lease round trip on the data socket costs ~150-250 us of Python and wake-ups on
both sides, more than copying a 1 MiB block (~40 us). With the index in a second
shared-memory segment (``<dram segment>.idx``), a same-host get is a hash probe, a
header check and one copy; the server hears of the hit afterwards (a TOUCH frame, sent
in batches) for its eviction order and counters.

Layout (little-endian, 8-byte aligned)::

    header  (4096 B): magic "KVSIDX01" | version u32 | ways u32 | nbuckets u64 |
                      owner pid u64 | live u64
    slots   (32 B each, ``ways`` per bucket): seq u64 | key 16 B | extent offset i64

A key lives in bucket ``key[:8] % nbuckets`` (keys are BLAKE2b digests: uniform), in any
free way; a full bucket leaves the key unpublished (its reads take the lease path).

Correctness is a sequence lock per slot, written only by the server under the node's
lock: ``seq`` goes odd, the key and offset change, ``seq`` goes even. The server takes a
block's slot down (unpublish) *before* its extent can be freed or reused, and publishes
only after header and payload are in place. A reader takes ``seq`` (even), checks the key,
parses the block header at the offset (its key and namespace must match), copies the
payload, and reads ``seq`` again: unchanged means no unpublish happened meanwhile, so the
extent was not reused while it copied and the bytes are the block's. Anything else is a
fallback to the leased path, never a wrong answer. This relies on x86-64's store and
load ordering (TSO); on other machines readers do not use the index.

Each ``seq`` is read and written as one aligned 8-byte word (a numpy uint64 element),
so a reader never sees half of an update.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import struct

import numpy as np

from kvstore.errors import StorageError
from kvstore.shm.segment import SHM_DIR, map_segment, unmap

__all__ = ["IndexReader", "IndexWriter", "index_name", "reader_supported"]

MAGIC = b"KVSIDX01"
VERSION = 1
WAYS = 8
SLOT = 32
HEADER = 4096
_HEAD = struct.Struct("<8sIIQQQ")  # magic, version, ways, nbuckets, pid, live
_LIVE_AT = 32  # byte offset of ``live`` in the header
KEY_LEN = 16


def index_name(segment: str) -> str:
    """The index segment's name next to a DRAM segment ``segment``."""
    return f"{segment}.idx"


def reader_supported() -> bool:
    """Whether this machine's memory ordering makes the lock-free read safe (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def buckets_for(capacity: int) -> int:
    """Buckets for a DRAM tier of ``capacity`` bytes: a slot per 16 KiB, at least 512
    buckets, at most 128K (32 MiB of index); a power of two."""
    want = max(capacity // (16 << 10) // WAYS, 512)
    n = 1
    while n < want and n < (1 << 17):
        n <<= 1
    return n


def _bucket(key: bytes, nbuckets: int) -> int:
    return int.from_bytes(key[:8], "little") & (nbuckets - 1)


class IndexWriter:
    """The server's side: creates the index segment and publishes DRAM blocks.

    Not thread-safe: every call is made under the block index's lock (kvstore/node/index.py).
    """

    def __init__(self, segment: str, capacity: int) -> None:
        self.name = index_name(segment)
        self.nbuckets = buckets_for(capacity)
        self.size = HEADER + self.nbuckets * WAYS * SLOT
        path = os.path.join(SHM_DIR, self.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a crashed predecessor's index under a configured name
        self._mm: mmap.mmap | None = map_segment(self.name, self.size, create=True)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        nslots = self.nbuckets * WAYS
        self._seq = np.ndarray((nslots,), np.uint64, self._mm, HEADER, (SLOT,))
        self._off = np.ndarray((nslots,), np.int64, self._mm, HEADER + 24, (SLOT,))
        self._slot_of: dict[bytes, int] = {}
        self._used = np.zeros(self.nbuckets, dtype=np.uint8)  # ways taken per bucket
        self.unpublished = 0  # blocks left out because their bucket was full
        self._mm[:HEADER] = _HEAD.pack(MAGIC, VERSION, WAYS, self.nbuckets, os.getpid(), 1).ljust(
            HEADER, b"\0"
        )

    def __len__(self) -> int:
        return len(self._slot_of)

    def publish(self, key: bytes, offset: int) -> bool:
        """Make ``key`` findable at extent ``offset`` (its header and payload are in
        place). False when the key is not a 16-byte key or its bucket is full."""
        if self._mm is None or len(key) != KEY_LEN:
            return False
        self.unpublish(key)
        b = _bucket(key, self.nbuckets)
        if self._used[b] >= WAYS:
            self.unpublished += 1
            return False
        base = b * WAYS
        for slot in range(base, base + WAYS):
            if not self._off[slot]:
                break
        else:  # pragma: no cover - _used says a way is free
            self.unpublished += 1
            return False
        seq = int(self._seq[slot])
        self._seq[slot] = seq + 1  # odd: readers back off
        at = HEADER + slot * SLOT + 8
        self._view[at : at + KEY_LEN] = np.frombuffer(key, dtype=np.uint8)
        self._off[slot] = offset + 1  # 0 means empty
        self._seq[slot] = seq + 2
        self._slot_of[key] = slot
        self._used[b] += 1
        return True

    def unpublish(self, key: bytes) -> None:
        """Take ``key`` down; must happen before its extent is freed or moved."""
        slot = self._slot_of.pop(key, None)
        if slot is None or self._mm is None:
            return
        seq = int(self._seq[slot])
        self._seq[slot] = seq + 1
        self._off[slot] = 0
        at = HEADER + slot * SLOT + 8
        self._view[at : at + KEY_LEN] = 0
        self._seq[slot] = seq + 2
        self._used[slot // WAYS] -= 1

    def close(self) -> None:
        """Mark the index dead (readers stop using it), unmap and unlink it."""
        if self._mm is None:
            return
        self._mm[_LIVE_AT : _LIVE_AT + 8] = b"\0" * 8
        del self._seq, self._off, self._view
        unmap(self._mm)
        self._mm = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


class IndexReader:
    """A client's read-only mapping of a server's index."""

    def __init__(self, name: str) -> None:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise StorageError(f"cannot open {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise StorageError(f"{path} is too small for an index")
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            raise StorageError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        magic, version, ways, nbuckets, pid, _live = _HEAD.unpack_from(self._mm, 0)
        if magic != MAGIC or version != VERSION or ways != WAYS:
            self.close()
            raise StorageError(f"{path} is not a kvstore index this client reads")
        if HEADER + nbuckets * WAYS * SLOT > size:
            self.close()
            raise StorageError(f"{path} is shorter than its {nbuckets} buckets")
        self.name = name
        self.nbuckets = int(nbuckets)
        self.pid = int(pid)
        nslots = self.nbuckets * WAYS
        mm = self._mm
        self._seq = np.ndarray((nslots,), np.uint64, mm, HEADER, (SLOT,))
        self._off = np.ndarray((nslots,), np.int64, mm, HEADER + 24, (SLOT,))
        self._live = np.ndarray((1,), np.uint64, mm, _LIVE_AT)

    def alive(self) -> bool:
        """Whether the server that owns the index is still serving it."""
        if self._mm is None or not self._live[0]:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # exists, another user's: the segment's mode says it is ours
        return True

    def find(self, key: bytes) -> tuple[int, int] | None:
        """``(slot, seq)`` of ``key``'s slot at a moment it was stable, or None."""
        mm = self._mm
        if mm is None:
            return None
        start = HEADER + _bucket(key, self.nbuckets) * WAYS * SLOT
        end = start + WAYS * SLOT
        pos = mm.find(key, start + 8, end)
        while pos >= 0 and (pos - start - 8) % SLOT:
            pos = mm.find(key, pos + 1, end)  # a match across two fields: keep looking
        if pos < 0:
            return None
        slot = (pos - 8 - HEADER) // SLOT
        seq = int(self._seq[slot])
        if seq & 1 or mm[pos : pos + KEY_LEN] != key:
            return None
        return slot, seq

    def offset(self, slot: int) -> int:
        """The extent offset the slot names (-1 when empty); valid only if
        :meth:`unchanged` holds afterwards."""
        return int(self._off[slot]) - 1

    def unchanged(self, slot: int, seq: int) -> bool:
        """Whether the slot has not been rewritten since ``seq`` was read."""
        return int(self._seq[slot]) == seq

    def close(self) -> None:
        """Drop the mapping."""
        if self._mm is None:
            return
        for attr in ("_seq", "_off", "_live"):
            if hasattr(self, attr):
                delattr(self, attr)
        unmap(self._mm)
        self._mm = None
