"""SSD tier: block bytes in one slab file, an lmdb index saying where they are.

Why not lmdb values: lmdb moves every value through its page cache (or a dirtied mmap
with writemap) and wrote 1 MiB values at 0.9-1.95 GB/s where the disk takes O_DIRECT at
2.8 GB/s. Here payloads go from the caller's buffer to the device with O_DIRECT and lmdb
holds only small records, so a commit costs tens of microseconds (benchmarks/bench_ssd.py).

Layout: ``index/`` (lmdb: db "records", key -> offset u64, extent u64, packed header;
db "meta"), ``slab`` (grows up to ``capacity`` bytes) and ``LOCK`` (flock: one process per
directory). A record is one extent of whole pages, a header page then the payload padded
to a page: the payload starts page aligned, so an aligned caller buffer (a shared-memory
slab) moves with no staging copy, and for page-multiple payloads the header page costs
what an inline header would (header + payload round up to the same page count).

Crash consistency: data first, index commit last. An extent is written while nothing
references it and is visible only once its lmdb transaction commits, so a process killed
anywhere leaves the old version or the new one, never half a block; the index commit
plays the part of DESIGN's temp-file rename. The allocator is rebuilt from the index on
open (free space = the gaps). Bytes that rot on disk, or an index rolled back past a
reused extent (power loss with sync=False), fail the checks on read (on-disk header
equals the indexed one, payload matches its xxh3): the record is dropped, never served.
With ``sync=False`` (a cache's default) a clean close or a process crash loses nothing
committed; power loss may lose recent commits, and an index lmdb finds corrupt is reset
to empty. ``sync=True`` fdatasyncs the slab before each commit and commits synchronously.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from kvstore.blocks import HEADER_SIZE, BlockHeader, verify_payload
from kvstore.errors import (
    BlockTooLarge,
    CapacityError,
    ClosedError,
    ConfigError,
    ConflictError,
    CorruptBlock,
    InvalidValue,
    KVStoreError,
    NotFound,
    StorageError,
)
from kvstore.keys import as_key
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import NO_PLACE, Payload, Tier
from kvstore.tiers.slab import _FLAGS, PAGE, _Extents, _Slab, extent_len

__all__ = ["PAGE", "DiskTier", "extent_len"]

_MIB = 1 << 20
_FORMAT = b"kvstore-disk/1"
_LOC = struct.Struct("<QQ")  # extent offset, extent length
_RESET_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)
_NOTHING = np.empty(0, dtype=np.uint8)
# No writemap for the index: it would save ~6 us a commit, but a full disk under a sparse
# writemap file kills the process with SIGBUS instead of failing a write.
_LMDB: dict[str, Any] = {"max_dbs": 2, "readahead": False, "meminit": False}


@contextmanager
def _io_errors(what: str) -> Iterator[None]:
    """The one place lmdb and OS errors become StorageError (our own errors pass)."""
    try:
        yield
    except KVStoreError:
        raise
    except (OSError, lmdb.Error) as exc:
        raise StorageError(f"{what}: {exc}") from exc


def _flat(buf: Any, what: str) -> np.ndarray:
    try:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"{what} must be a C-contiguous buffer") from exc


@dataclass(frozen=True, slots=True)
class _Record:
    """Where one block lives. ``raw`` is the packed header, compared bytewise on reads."""

    offset: int
    length: int
    header: BlockHeader
    raw: bytes


class DiskTier(Tier):
    """The SSD tier: persistent, crash-consistent, reopened with its blocks after a restart.

    Sizes are bytes allocated on disk (:func:`extent_len`): a page-multiple payload + a page.
    """

    kind = TierKind.SSD

    def __init__(self, path: str | os.PathLike[str], capacity: int, *, sync: bool = False):
        if capacity < 2 * PAGE:
            raise ConfigError(f"SSD tier capacity must be at least {2 * PAGE} bytes")
        self._path = Path(path)
        self._size = capacity // PAGE * PAGE
        self._sync = sync
        self.corrupt_count = 0  # records dropped because their bytes did not verify
        # Concurrency contract. ``_cond`` (a Condition over one plain Lock) guards every
        # field below and serializes index transactions, so lmdb's commit order is the
        # order in which versions become visible. Slab I/O runs outside it: a writer owns
        # its freshly allocated extent, which nothing references until its index commit;
        # a reader pins the extent it reads, and an extent freed (deleted, overwritten,
        # found corrupt) while pinned returns to the allocator only when its last reader
        # unpins, so it is never reused under a reader. ``close`` sets ``_closed`` and
        # waits for ``_inflight`` to drain before closing any file. Nothing else is
        # locked while it is held (lmdb's internal write mutex excepted).
        self._cond = threading.Condition(threading.Lock())
        self._records: dict[bytes, _Record] = {}
        self._extents = _Extents(self._size)
        self._used = 0
        self._pins: dict[int, int] = {}  # extent offset -> readers in flight
        self._deferred: dict[int, int] = {}  # offset -> length, freed while pinned
        self._inflight = 0
        self._closed = False
        self._lock_fd: int | None = None
        self._env: Any = None
        self._slab: Any = None  # _Slab once open: Any spares an assert per I/O
        try:
            with _io_errors(f"opening SSD tier at {self._path}"):
                self._path.mkdir(parents=True, exist_ok=True)
                self._lock_dir()
                try:
                    self._open_index()
                except _RESET_ERRORS:  # a cache may start empty; it may not refuse to start
                    if self._env is not None:
                        self._env.close()
                    shutil.rmtree(self._path / "index")
                    self._open_index()
                self._slab = _Slab(self._path / "slab", self._size)
        except BaseException:
            self._release()
            raise

    def _lock_dir(self) -> None:
        fd = os.open(self._path / "LOCK", _FLAGS, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise ConflictError(f"SSD tier {self._path} is open elsewhere") from exc
        self._lock_fd = fd

    def _open_index(self) -> None:
        """Open lmdb, load and check every record, rebuild the allocator from them."""
        self._env = None
        self._records.clear()
        records = self._size // (2 * PAGE) + 1  # at most one per two pages, ~200 B each
        size, sync = max(64 * _MIB, records * 512), self._sync
        self._env = lmdb.open(str(self._path / "index"), size, sync=sync, metasync=sync, **_LMDB)
        self._db = self._env.open_db(b"records")
        meta = self._env.open_db(b"meta")
        with self._env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=meta)
            if fmt is None:
                txn.put(b"format", _FORMAT, db=meta)
            elif fmt != _FORMAT:
                raise StorageError(f"{self._path} holds format {fmt!r}, not {_FORMAT!r}")
        with self._env.begin(db=self._db) as txn:
            found = [(self._decode(k, v), k) for k, v in txn.cursor()]
        good = sorted(((r, k) for r, k in found if r is not None), key=lambda e: e[0].offset)
        bad = [k for r, k in found if r is None]
        end = 0
        for rec, key in good:
            if rec.offset < end:  # overlaps its neighbour: one of the two is wrong
                bad.append(key)
                continue
            self._records[key] = rec
            end = rec.offset + rec.length
        if bad:
            with self._env.begin(write=True, db=self._db) as txn:
                for key in bad:
                    txn.delete(key)
            self.corrupt_count += len(bad)
        live = [(r.offset, r.length) for r in self._records.values()]  # in offset order
        self._extents.rebuild(live)
        self._used = sum(length for _, length in live)

    def _decode(self, key: bytes, value: bytes) -> _Record | None:
        if len(key) != 16 or len(value) != _LOC.size + HEADER_SIZE:
            return None
        offset, length = _LOC.unpack_from(value)
        raw = value[_LOC.size :]
        try:
            header = BlockHeader.unpack(raw)
        except CorruptBlock:
            return None
        if header.key != key or offset % PAGE or length != extent_len(header.payload_len):
            return None
        if offset + length > self._size:  # reopened with a smaller capacity
            return None
        return _Record(offset, length, header, raw)

    @property
    def capacity(self) -> int:
        """Slab size: the capacity asked for, rounded down to a page."""
        return self._size

    @property
    def used(self) -> int:
        """Bytes of extents allocated, including ones being written or still being read."""
        return self._used

    def footprint(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` (header + payload) takes on disk."""
        return extent_len(max(nbytes - HEADER_SIZE, 0))

    def fits_ever(self, nbytes: int) -> bool:
        return self.footprint(nbytes) <= self._size

    def has_room(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` (header + payload) can be written right now: one
        free extent that long, not merely that many free bytes."""
        with self._cond:
            self._check_open()
            return self._extents.can_alloc(self.footprint(nbytes))

    # -- the tier seam (blocks are found by key; their place is NO_PLACE) ---------------

    def allocate(self, nbytes: int) -> int | None:
        return NO_PLACE if self.has_room(nbytes) else None

    def release(self, key: bytes, place: int) -> None:
        self.delete(key)

    def payload(self, place: int, nbytes: int) -> None:
        return None  # bytes are copied out with load, verified

    def seal(self, place: int, header: BlockHeader) -> None:
        raise StorageError("the SSD tier stores whole blocks; it takes no reservations")

    def store(self, key: bytes, place: int, header: BlockHeader, src: Payload) -> BlockHeader:
        header, payload = src.land(header)  # device bytes are checked on the way
        self.write(key, header.pack(), payload)
        return header

    def load(self, key: bytes, place: int, header: BlockHeader, dst: Payload) -> None:
        self.read_into(key, dst.fill_buffer())
        dst.flush()

    def stored(self) -> Iterator[tuple[bytes, BlockHeader]]:
        return self.scan()

    def __len__(self) -> int:
        with self._cond:
            self._check_open()
            return len(self._records)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            self._check_open()
            return isinstance(key, bytes) and key in self._records

    def write(self, key: bytes, header: bytes, payload: Any) -> None:
        """Store a block, replacing any older version once this one is committed.

        ``header`` is ``BlockHeader.pack()`` for this key and payload. The payload checksum
        in it is trusted here (computed from the writer's bytes) and checked on every read.
        """
        key, raw = as_key(key), bytes(header)
        hdr = self._check_header(key, raw)
        src = _flat(payload, "payload")
        if src.nbytes != hdr.payload_len:
            raise InvalidValue(f"payload is {src.nbytes} bytes, header says {hdr.payload_len}")
        need = extent_len(src.nbytes)
        if need > self._size:
            raise BlockTooLarge(f"a {need}-byte extent never fits a {self._size}-byte SSD tier")
        with self._cond:
            self._check_open()
            offset = self._extents.alloc(need)
            if offset is None:
                raise CapacityError(f"no free {need}-byte extent in the SSD tier")
            self._used += need
            self._inflight += 1
        committed = False
        try:
            with _io_errors("SSD tier write"):
                self._slab.write(offset, raw, src)
                if self._sync:
                    os.fdatasync(self._slab.fd)
            self._commit_record(key, _Record(offset, need, hdr, raw))
            committed = True
        finally:
            with self._cond:
                if not committed:
                    self._extents.free(offset, need)
                    self._used -= need
                self._inflight -= 1
                self._cond.notify_all()

    @staticmethod
    def _check_header(key: bytes, raw: bytes) -> BlockHeader:
        if len(raw) != HEADER_SIZE:
            raise InvalidValue(f"header must be {HEADER_SIZE} bytes, got {len(raw)}")
        try:
            hdr = BlockHeader.unpack(raw)
        except CorruptBlock as exc:
            raise InvalidValue(f"header does not parse: {exc}") from exc
        if hdr.key != key:
            raise InvalidValue("header names another key")
        return hdr

    def _commit_record(self, key: bytes, rec: _Record) -> None:
        """Make ``rec`` the visible version of ``key``, its data being on disk already:
        the index commit is the linearization point of a write."""
        with self._cond:
            with _io_errors("SSD index commit"), self._env.begin(write=True, db=self._db) as txn:
                txn.put(key, _LOC.pack(rec.offset, rec.length) + rec.raw)
            old = self._records.get(key)
            self._records[key] = rec
            if old is not None:
                self._free(old)

    def delete(self, key: bytes) -> int:
        """Remove a block; returns the bytes its extent held (0 if absent)."""
        key = as_key(key)
        with self._cond:
            self._check_open()
            rec = self._records.get(key)
            if rec is None:
                return 0
            self._drop(key, rec)
            return rec.length

    def _drop(self, key: bytes, rec: _Record) -> None:  # caller holds the lock
        with _io_errors("SSD index delete"), self._env.begin(write=True, db=self._db) as txn:
            txn.delete(key)
        del self._records[key]
        self._free(rec)

    def _free(self, rec: _Record) -> None:  # caller holds the lock
        if self._pins.get(rec.offset):
            self._deferred[rec.offset] = rec.length
        else:
            self._extents.free(rec.offset, rec.length)
            self._used -= rec.length

    def read_header(self, key: bytes) -> BlockHeader | None:
        """The indexed header of a block (no disk I/O), or None."""
        key = as_key(key)
        with self._cond:
            self._check_open()
            rec = self._records.get(key)
            return None if rec is None else rec.header

    def read_into(self, key: bytes, out: Any) -> BlockHeader:
        """Read a block's payload into ``out[:payload_len]``, verified.

        NotFound on a miss; CorruptBlock, after dropping the record, when the on-disk
        header or payload does not verify. ``out`` may then hold garbage: it is a miss.
        """
        key = as_key(key)
        dst = _flat(out, "out")
        if not dst.flags.writeable:
            raise InvalidValue("out is read-only")
        rec = self._pin(key)
        if rec is None:
            raise NotFound(f"block {key.hex()} is not in the SSD tier")
        try:
            n = rec.header.payload_len
            if dst.nbytes < n:
                raise InvalidValue(f"out holds {dst.nbytes} bytes, block has {n}")
            try:
                with _io_errors("SSD tier read"):
                    page, payload = self._slab.read(rec.offset, dst[:n])
                self._verify(key, rec, page)
                verify_payload(rec.header, payload)
            except CorruptBlock:
                self._drop_corrupt(key, rec)
                raise
            if payload.ctypes.data != dst.ctypes.data:  # read via staging
                dst[:n] = payload
            return rec.header
        finally:
            self._unpin(rec)

    def scan(self, *, verify: bool = True) -> Iterator[tuple[bytes, BlockHeader]]:
        """Every block held, as (key, header): how a restarted node re-announces its SSD.

        With ``verify`` each on-disk header is read (one page per block) and compared with
        the index; records that differ are dropped, not listed. Payload checksums are
        left to :meth:`read_into`, which reads the bytes anyway.
        """
        with self._cond:
            self._check_open()
            keys = list(self._records)
        for key in keys:
            rec = self._pin(key)
            if rec is None:
                continue  # deleted since the listing began
            try:
                if verify:
                    with _io_errors("SSD tier scan"):
                        page, _ = self._slab.read(rec.offset, _NOTHING)
                    self._verify(key, rec, page)
            except CorruptBlock:
                self._drop_corrupt(key, rec)
                continue
            finally:
                self._unpin(rec)
            yield key, rec.header

    @staticmethod
    def _verify(key: bytes, rec: _Record, page: np.ndarray) -> None:
        if rec.header.key != key or page[:HEADER_SIZE].tobytes() != rec.raw:
            raise CorruptBlock(f"on-disk header of {key.hex()} differs from the index")

    def _pin(self, key: bytes) -> _Record | None:
        with self._cond:
            self._check_open()
            rec = self._records.get(key)
            if rec is not None:
                self._pins[rec.offset] = self._pins.get(rec.offset, 0) + 1
                self._inflight += 1
            return rec

    def _unpin(self, rec: _Record) -> None:
        with self._cond:
            left = self._pins.pop(rec.offset) - 1
            if left:
                self._pins[rec.offset] = left
            elif rec.offset in self._deferred:
                self._extents.free(rec.offset, self._deferred[rec.offset])
                self._used -= self._deferred.pop(rec.offset)
            self._inflight -= 1
            self._cond.notify_all()

    def _drop_corrupt(self, key: bytes, rec: _Record) -> None:
        with self._cond:
            self.corrupt_count += 1
            if self._records.get(key) is rec:  # not already replaced by a newer version
                self._drop(key, rec)

    def _check_open(self) -> None:  # caller holds the lock
        if self._closed:
            raise ClosedError(f"SSD tier {self._path} is closed")

    def close(self) -> None:
        """Wait for in-flight reads and writes, flush, release the files; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                self._cond.wait()
        try:
            with _io_errors("closing SSD tier"):
                if self._slab is not None:
                    os.fsync(self._slab.fd)
                if self._env is not None:
                    self._env.sync(True)
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        if self._slab is not None:
            os.close(self._slab.fd)
            self._slab = None
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
