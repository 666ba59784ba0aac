"""Which leftover shared-memory segments a starting node reclaims (issue 18): only this
user's ``kvstore-<pid>-<hex>`` files (and their ``.idx``) whose pid is not a live process
and which nobody holds locked. Hermetic: a directory of plain files stands in for
/dev/shm (the real one: tests/service/test_write_path_segments.py)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvstore.errors import StorageError
from kvstore.shm.segment import SHM_DIR, map_segment, sweep_stale

DEAD = (1 << 22) + 12345  # above Linux's largest pid_max: never a live process


def _touch(d: Path, name: str) -> Path:
    p = d / name
    p.write_bytes(b"\0" * 64)
    return p


def test_only_unlocked_segments_of_dead_pids_are_swept(tmp_path: Path) -> None:
    dead = _touch(tmp_path, f"kvstore-{DEAD}-0badc0de")
    dead_idx = _touch(tmp_path, f"kvstore-{DEAD}-0badc0de.idx")
    orphan_idx = _touch(tmp_path, f"kvstore-{DEAD}-0000beef.idx")  # its segment went first
    mine = _touch(tmp_path, f"kvstore-{os.getpid()}-12345678")  # a live owner
    held = _touch(tmp_path, f"kvstore-{DEAD + 1}-feedf00d")  # another pid namespace's
    configured = _touch(tmp_path, "kvstore-node-a")  # --shm-name: its node replaces it
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        removed = sweep_stale(str(tmp_path))
    finally:
        os.close(fd)
    assert sorted(removed) == sorted([dead.name, dead_idx.name, orphan_idx.name])
    assert not dead.exists() and not dead_idx.exists() and not orphan_idx.exists()
    assert mine.exists() and held.exists() and configured.exists()
    assert sweep_stale(str(tmp_path)) == [held.name]  # its lock is gone now


def test_a_segment_larger_than_the_room_left_is_refused_not_a_sigbus() -> None:
    """A tmpfs file is created at any size and the first page past the room kills the
    process; the node refuses at start instead, naming the room and the fix."""
    st = os.statvfs(SHM_DIR)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    name = f"kvstore-{os.getpid()}-5ca1ab1e"
    with pytest.raises(StorageError, match=r"shared memory wanted, \d+ free .*--shm-size"):
        map_segment(name, too_big, create=True)
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # nothing left behind
    mm = map_segment(name, 1 << 16, create=True)  # a size that fits is mapped as ever
    try:
        assert len(mm) == 1 << 16
    finally:
        mm.close()
        os.unlink(os.path.join(SHM_DIR, name))
