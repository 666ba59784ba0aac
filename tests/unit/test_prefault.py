"""The background prefault of a segment mapping (kvstore/shm/prefault.py): after it, the
mapping's pages are resident in this process's page tables, so copies into it take no
faults; a limit bounds it, and stop() returns promptly."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.shm.prefault import Prefaulter

MIB = 1 << 20


def _rss_kib(address: int) -> int:
    """Rss of the mapping that starts at ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if all(c in "0123456789abcdef" for c in start) and int(start, 16) == address:
            for detail in lines[i + 1 :]:
                if detail.startswith("Rss:"):
                    return int(detail.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.fixture
def mapping() -> Iterator[mmap.mmap]:
    path = f"/dev/shm/kvtest-prefault-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 64 * MIB)
        mm = mmap.mmap(fd, 64 * MIB, mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    yield mm
    mm.close()  # the test's views are gone by now


def test_the_whole_mapping_becomes_resident(mapping: mmap.mmap) -> None:
    view = np.frombuffer(mapping, dtype=np.uint8)
    address = view.ctypes.data
    assert _rss_kib(address) == 0
    p = Prefaulter(address, view.nbytes, limit=1 << 40)
    assert p.wait(30)
    if p.populated == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert p.populated == view.nbytes
    assert _rss_kib(address) == view.nbytes // 1024
    assert not view.any()  # populating changes no byte


def test_the_limit_bounds_what_is_populated(mapping: mmap.mmap) -> None:
    view = np.frombuffer(mapping, dtype=np.uint8)
    p = Prefaulter(view.ctypes.data, view.nbytes, limit=8 * MIB)
    assert p.wait(30)
    if p.populated == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert p.populated == 8 * MIB
    assert _rss_kib(view.ctypes.data) == 8 * MIB // 1024


def test_zero_turns_it_off_and_stop_is_prompt(mapping: mmap.mmap) -> None:
    view = np.frombuffer(mapping, dtype=np.uint8)
    off = Prefaulter(view.ctypes.data, view.nbytes, limit=0)
    assert off.wait(0) and off.populated == 0
    p = Prefaulter(view.ctypes.data, view.nbytes, limit=1 << 40)
    p.stop()  # returns within one chunk; the mapping may then be closed
    assert p.wait(0)
