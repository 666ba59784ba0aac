"""The SSD tier against real lmdb and slab files (tmp_path on disk, not tmpfs)."""

from __future__ import annotations

import errno
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.blocks import HEADER_SIZE, BlockHeader, describe
from kvstore.errors import (
    BlockTooLarge,
    CapacityError,
    ClosedError,
    ConflictError,
    CorruptBlock,
    InvalidValue,
    NotFound,
)
from kvstore.tier_kinds import TierKind
from kvstore.tiers import slab
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.slab import PAGE, extent_len

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(key: bytes, version: int, nbytes: int) -> tuple[bytes, np.ndarray]:
    """A payload that names its key and version in every 24 bytes, and its header."""
    pattern = np.frombuffer(version.to_bytes(8, "little") + key, dtype=np.uint8)
    payload = np.resize(pattern, nbytes)
    return BlockHeader.for_value(key, describe(payload), payload).pack(), payload


def aligned(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def slab_offset(path: Path, header: bytes) -> int:
    """Where a header sits in the slab file, found from the outside."""
    pos = (path / "slab").read_bytes().find(header)
    assert pos >= 0 and pos % PAGE == 0
    return pos


def flip(path: Path, offset: int) -> None:
    with open(path / "slab", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def tier(tmp_path: Path):
    t = DiskTier(tmp_path / "ssd", 32 * MiB)
    yield t
    t.close()


@pytest.mark.parametrize("nbytes", [1, 1000, PAGE, PAGE + 1, 65536 + 3, MiB, 2 * MiB])
def test_roundtrip_sizes(tier: DiskTier, nbytes: int) -> None:
    key = key_of(nbytes)
    header, payload = block(key, 1, nbytes)
    tier.write(key, header, payload)
    assert tier.kind is TierKind.SSD
    assert key in tier and len(tier) == 1
    assert tier.used == extent_len(nbytes) == tier.footprint(nbytes + HEADER_SIZE)
    assert tier.read_header(key) == BlockHeader.unpack(header)
    for out in (aligned(nbytes), np.empty(nbytes + 7, np.uint8)[7:], bytearray(nbytes + 5)):
        got = tier.read_into(key, out)
        assert got == BlockHeader.unpack(header)
        assert bytes(memoryview(out)[:nbytes]) == payload.tobytes()


@pytest.mark.parametrize("how", ["no O_DIRECT", "EINVAL"])
def test_buffered_fallback_when_direct_io_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "no O_DIRECT":
        monkeypatch.setattr(slab, "_O_DIRECT", 0)
    else:  # as tmpfs did before Linux 6.6
        real_open = os.open

        def refusing_open(path, flags, *args):
            if flags & slab._O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", refusing_open)
    with DiskTier(tmp_path / "ssd", 8 * MiB) as t:
        assert t._slab is not None and not t._slab.direct
        for n in (100, MiB):
            header, payload = block(key_of(n), 1, n)
            t.write(key_of(n), header, memoryview(payload.tobytes())[:])
            out = bytearray(n)
            t.read_into(key_of(n), out)
            assert bytes(out) == payload.tobytes()


def test_overwrite_replaces_and_frees_old_extent(tier: DiskTier) -> None:
    key = key_of(1)
    tier.write(key, *block(key, 1, 3 * PAGE))
    header, payload = block(key, 2, MiB)
    tier.write(key, header, payload)
    assert len(tier) == 1 and tier.used == extent_len(MiB)
    out = np.empty(MiB, np.uint8)
    tier.read_into(key, out)
    assert np.array_equal(out, payload)


def test_delete_frees_space(tier: DiskTier) -> None:
    for i in range(3):
        tier.write(key_of(i), *block(key_of(i), 0, MiB))
    before = tier.used
    assert tier.delete(key_of(1)) == extent_len(MiB)
    assert tier.used == before - extent_len(MiB)
    assert tier.delete(key_of(1)) == 0
    assert tier.read_header(key_of(1)) is None and key_of(1) not in tier
    with pytest.raises(NotFound):
        tier.read_into(key_of(1), bytearray(MiB))


def test_capacity_full_then_room_after_delete(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "ssd", 4 * extent_len(MiB)) as t:
        for i in range(4):
            t.write(key_of(i), *block(key_of(i), 0, MiB))
        assert not t.has_room(MiB + HEADER_SIZE)
        with pytest.raises(CapacityError):
            t.write(key_of(9), *block(key_of(9), 0, MiB))
        t.delete(key_of(2))
        assert t.has_room(MiB + HEADER_SIZE)
        t.write(key_of(9), *block(key_of(9), 0, MiB))
        assert t.used == t.capacity


def test_too_big_and_bad_inputs(tier: DiskTier) -> None:
    big = 40 * MiB
    header, payload = block(key_of(1), 0, big)
    assert not tier.fits_ever(big + HEADER_SIZE)
    with pytest.raises(BlockTooLarge):
        tier.write(key_of(1), header, payload)
    header, payload = block(key_of(1), 0, 100)
    with pytest.raises(InvalidValue):  # the header names another key
        tier.write(key_of(2), header, payload)
    with pytest.raises(InvalidValue):  # payload length disagrees with the header
        tier.write(key_of(1), header, payload[:50])
    tier.write(key_of(1), header, payload)
    with pytest.raises(InvalidValue):
        tier.read_into(key_of(1), bytearray(99))
    with pytest.raises(InvalidValue):
        tier.read_into(key_of(1), bytes(100))
    assert tier.used == extent_len(100)


def test_reopen_lists_blocks_and_reads_them_back(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    sizes = {key_of(i): (i + 1) * 100_000 for i in range(6)}
    with DiskTier(path, 16 * MiB) as t:
        for k, n in sizes.items():
            t.write(k, *block(k, 7, n))
        t.delete(key_of(2))
        del sizes[key_of(2)]
        used = t.used
    with DiskTier(path, 16 * MiB) as t:
        assert t.used == used and len(t) == len(sizes)
        assert {k: h.payload_len for k, h in t.scan()} == sizes
        k = key_of(9)  # the allocator was rebuilt: a new write clobbers nothing
        t.write(k, *block(k, 1, 300_000))
        sizes[k] = 300_000
        for k, n in sizes.items():
            out = np.empty(n, np.uint8)
            t.read_into(k, out)
            assert np.array_equal(out, block(k, 1 if k == key_of(9) else 7, n)[1])


def test_sync_mode_and_smaller_capacity_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    with DiskTier(path, 4 * extent_len(MiB), sync=True) as t:
        for i in range(4):
            t.write(key_of(i), *block(key_of(i), 0, MiB))
    with DiskTier(path, 2 * extent_len(MiB)) as t:  # blocks past the new end are dropped
        assert sorted(k for k, _ in t.scan()) == [key_of(0), key_of(1)]
        assert t.used == t.capacity == 2 * extent_len(MiB)
        assert (path / "slab").stat().st_size == t.capacity


def test_corrupt_payload_byte_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    with DiskTier(path, 8 * MiB) as t:
        header, payload = block(key_of(1), 0, MiB)
        t.write(key_of(1), header, payload)
        t.write(key_of(2), *block(key_of(2), 0, MiB))
        flip(path, slab_offset(path, header) + PAGE + 12345)
        out = np.zeros(MiB, np.uint8)
        with pytest.raises(CorruptBlock):
            t.read_into(key_of(1), out)
        assert t.corrupt_count == 1 and key_of(1) not in t
        assert t.used == extent_len(MiB)
        with pytest.raises(NotFound):
            t.read_into(key_of(1), out)
        t.read_into(key_of(2), out)  # the neighbour is untouched
    with DiskTier(path, 8 * MiB) as t:
        assert [k for k, _ in t.scan()] == [key_of(2)]


@pytest.mark.parametrize("via", ["read_into", "scan"])
def test_corrupt_header_byte_is_a_miss(tmp_path: Path, via: str) -> None:
    path = tmp_path / "ssd"
    with DiskTier(path, 8 * MiB) as t:
        header, payload = block(key_of(1), 0, 5000)
        t.write(key_of(1), header, payload)
        flip(path, slab_offset(path, header) + 40)
        if via == "read_into":
            with pytest.raises(CorruptBlock):
                t.read_into(key_of(1), bytearray(5000))
        else:
            assert list(t.scan()) == []
        assert t.corrupt_count == 1 and len(t) == 0 and t.used == 0


def test_slab_cut_short_drops_the_records_past_its_end(tmp_path: Path) -> None:
    """As after a power loss that kept the index commit but not the file's new size."""
    path = tmp_path / "ssd"
    with DiskTier(path, 8 * MiB) as t:
        for i in range(3):
            t.write(key_of(i), *block(key_of(i), 0, 100_000))
    os.truncate(path / "slab", extent_len(100_000) + PAGE)  # block 1 keeps its header page
    with DiskTier(path, 8 * MiB) as t:
        assert [k for k, _ in t.scan()] == [key_of(0), key_of(1)]  # block 2: header gone
        with pytest.raises(CorruptBlock):
            t.read_into(key_of(1), bytearray(100_000))  # block 1: payload gone
        assert t.corrupt_count == 2 and t.used == extent_len(100_000)
        t.read_into(key_of(0), bytearray(100_000))


def test_corrupt_index_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    with DiskTier(path, 8 * MiB) as t:
        t.write(key_of(1), *block(key_of(1), 0, 5000))
    (path / "index" / "data.mdb").write_bytes(os.urandom(3 * PAGE))
    with DiskTier(path, 8 * MiB) as t:
        assert len(t) == 0 and t.used == 0


def test_close_then_use_raises(tmp_path: Path) -> None:
    t = DiskTier(tmp_path / "ssd", 8 * MiB)
    header, payload = block(key_of(1), 0, 100)
    t.write(key_of(1), header, payload)
    t.close()
    t.close()  # idempotent
    calls = [
        lambda: t.write(key_of(1), header, payload),
        lambda: t.read_into(key_of(1), bytearray(100)),
        lambda: t.read_header(key_of(1)),
        lambda: t.delete(key_of(1)),
        lambda: list(t.scan()),
        lambda: len(t),
        lambda: key_of(1) in t,
        lambda: t.has_room(100),
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()


def test_one_process_per_directory(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "ssd", 8 * MiB), pytest.raises(ConflictError):
        DiskTier(tmp_path / "ssd", 8 * MiB)


def test_extent_freed_under_a_reader_is_not_reused(tier: DiskTier, monkeypatch) -> None:
    """A reader pinned mid-read; the block is deleted and a new one written meanwhile."""
    header, payload = block(key_of(1), 0, MiB)
    tier.write(key_of(1), header, payload)
    assert tier._slab is not None
    slab_read = tier._slab.read
    in_read, release = threading.Event(), threading.Event()

    def paused_read(*args, **kwargs):
        got = slab_read(*args, **kwargs)
        in_read.set()
        release.wait(5)
        return got

    monkeypatch.setattr(tier._slab, "read", paused_read)
    out = np.zeros(MiB, np.uint8)
    reader = threading.Thread(target=tier.read_into, args=(key_of(1), out))
    reader.start()
    assert in_read.wait(5)
    assert tier.delete(key_of(1)) == extent_len(MiB)
    monkeypatch.setattr(tier._slab, "read", slab_read)
    tier.write(key_of(2), *block(key_of(2), 0, MiB))  # must land elsewhere
    assert tier.used == 2 * extent_len(MiB)  # the deleted extent is still held
    release.set()
    reader.join(5)
    assert np.array_equal(out, payload)
    assert tier.used == extent_len(MiB)


def test_threads_write_read_delete(tier: DiskTier) -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        out = np.empty(256 * 1024, np.uint8)
        try:
            for i in range(150):
                k = key_of(rng.randrange(12))
                op = rng.random()
                if op < 0.4:
                    tier.write(k, *block(k, i, rng.choice([4096, 100_000, 256 * 1024])))
                elif op < 0.9:
                    try:
                        h = tier.read_into(k, out)
                    except NotFound:
                        continue
                    version = int.from_bytes(out[:8].tobytes(), "little")
                    assert np.array_equal(out[: h.payload_len], block(k, version, h.payload_len)[1])
                else:
                    tier.delete(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and tier.corrupt_count == 0
    assert tier.used == sum(extent_len(h.payload_len) for _, h in tier.scan())


def test_allocator_matches_a_page_map() -> None:
    """Random alloc/free against a brute-force page map: no overlap, no lost space."""
    rng = random.Random(1)
    pages = 64
    ext = slab._Extents(pages * PAGE)
    owner = [False] * pages
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            start, n = live.pop(rng.randrange(len(live)))
            ext.free(start, n)
            owner[start // PAGE : (start + n) // PAGE] = [False] * (n // PAGE)
            continue
        n = rng.choice([1, 1, 2, 3, 8]) * PAGE
        fits = any(not any(owner[p : p + n // PAGE]) for p in range(pages - n // PAGE + 1))
        assert ext.can_alloc(n) == fits
        start = ext.alloc(n)
        assert (start is not None) == fits
        if start is None:
            continue
        span = owner[start // PAGE : (start + n) // PAGE]
        assert len(span) == n // PAGE and not any(span)
        owner[start // PAGE : (start + n) // PAGE] = [True] * (n // PAGE)
        live.append((start, n))


CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.unit.test_disk_tier import block, key_of
from kvstore.tiers import disk, slab
path, mode, arg, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "commit":  # SIGKILL between the data write and the index commit
    commits = [0]
    real_commit = disk.DiskTier._commit_record
    def commit(self, key, rec):
        commits[0] += 1
        if commits[0] > arg:
            os.kill(os.getpid(), signal.SIGKILL)
        real_commit(self, key, rec)
    disk.DiskTier._commit_record = commit
elif mode == "torn":  # SIGKILL halfway through the data write itself
    real_write = slab._Slab.write
    writes = [0]
    def write(self, offset, raw, payload):
        writes[0] += 1
        if writes[0] > arg:
            half = payload[: payload.nbytes // 2 // 4096 * 4096]
            real_write(self, offset, raw, half)
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(self, offset, raw, payload)
    slab._Slab.write = write
tier = disk.DiskTier(path, 16 << 20)
for version in range(first, first + 1_000_000):
    k = key_of(version % 24)
    tier.write(k, *block(k, version, 40_000 + (version % 7) * 20_000))
    if version == first + 8:
        print("ready", flush=True)
"""


def run_child(path: Path, mode: str, arg: int, first: int) -> subprocess.Popen[str]:
    code = CHILD.format(root=str(ROOT))
    cmd = [sys.executable, "-c", code, str(path), mode, str(arg), str(first)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def check_all_verified(path: Path) -> dict[bytes, int]:
    """Reopen after a kill: every listed block reads back whole, as some version written."""
    versions = {}
    with DiskTier(path, 16 << 20) as t:
        listed = list(t.scan())
        assert t.corrupt_count == 0
        assert t.used == sum(extent_len(h.payload_len) for _, h in listed)
        for k, h in listed:
            out = np.empty(h.payload_len, np.uint8)
            t.read_into(k, out)
            version = int.from_bytes(out[:8].tobytes(), "little")
            assert np.array_equal(out, block(k, version, h.payload_len)[1])
            versions[k] = version
    return versions


@pytest.mark.process
def test_sigkill_mid_write_loop_leaves_no_half_block(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    first = 0
    for _ in range(3):
        child = run_child(path, "loop", 0, first)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(random.uniform(0.05, 0.3))
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
        versions = check_all_verified(path)
        assert len(versions) >= 9
        first = max(versions.values()) + 1


@pytest.mark.process
@pytest.mark.parametrize("mode", ["commit", "torn"])
def test_sigkill_between_data_and_commit(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "ssd"
    child = run_child(path, mode, 30, 0)  # 30 writes land, the 31st (version 30) is cut
    child.communicate(timeout=20)
    assert child.returncode == -signal.SIGKILL
    versions = check_all_verified(path)
    assert len(versions) == 24
    assert max(versions.values()) == 29  # version 30 was never committed
    assert versions[key_of(30 % 24)] == 6  # its key still holds the previous version
