"""Named shared-memory segments: the DRAM tier's slab, mapped by the server and by
same-host clients alike, and how a crashed owner's segments are found and reclaimed.

A DRAM segment the node names itself is ``kvstore-<owner pid>-<random hex>`` (its
published index is that name plus ``.idx``), and its owner holds a shared ``flock`` on
it for as long as the tier is open. A process killed before it could unlink leaves
both files behind, each as large as the tier; :func:`sweep_stale` (run when a node
creates its segment) removes those whose owner is gone: the pid in the name is not a
live process here *and* nobody holds the lock. The pid alone would misjudge a segment
of another pid namespace sharing /dev/shm; the lock alone would take a segment whose
owner has created it but not yet locked it.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import mmap
import os
import re

from kvstore.errors import ConfigError, StorageError

__all__ = ["SHM_DIR", "hold_segment", "map_segment", "owned_name", "sweep_stale", "unmap"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_OWNED = re.compile(r"kvstore-(\d+)-[0-9a-f]{8}")
_INDEX_SUFFIX = ".idx"  # kvstore/shm/index.py's index_name


def owned_name(token: str) -> str:
    """A segment name that says which process owns it (``token``: 8 hex digits)."""
    return f"kvstore-{os.getpid()}-{token}"


def map_segment(name: str, size: int, *, create: bool) -> mmap.mmap:
    """Create (exclusively) or open a named shared-memory segment and map it.

    Plain files under /dev/shm rather than multiprocessing.shared_memory: that
    module's resource tracker unlinks segments it did not create when a client
    process exits, which would pull a node's DRAM tier from under it.
    """
    path = _path(name)
    if create:
        _check_room(path, size)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot {'create' if create else 'open'} {path}: {exc}") from exc
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise StorageError(f"{path} is smaller than {size} bytes")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise StorageError(f"cannot map {path}: {exc}") from exc
    finally:
        os.close(fd)


def _check_room(path: str, size: int) -> None:
    """Refuse a segment its file system has no room for. A tmpfs file is sparse: it
    is created at any size, and the first page touched past the room left kills the
    process with SIGBUS, with no error to read (a container's /dev/shm is often 64 MiB).
    Not a reservation (another process may fill the room later), but the clear error
    for the common case."""
    try:
        st = os.statvfs(os.path.dirname(path))
    except OSError:
        return  # nothing to tell: mapping will say what is wrong
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise StorageError(
            f"{path}: {size} bytes of shared memory wanted, {free} free in "
            f"{os.path.dirname(path)}: give it more room (docker --shm-size, or mount a "
            "larger tmpfs there), or ask for a smaller DRAM tier"
        )


def unmap(mm: mmap.mmap) -> bool:
    """Close a mapping unless a view of it is still alive; True when it closed.

    A mapping keeps a duplicate of its file's descriptor until it closes, and it cannot
    close while a numpy view of it lives. A view held only by a reference cycle (a
    failed call's traceback holding the frame that held an extent) would keep both
    until the cyclic collector happened to run, so a closed client could hold a
    segment's descriptor (and a dead node's memory) for as long: one collection here,
    at a close, frees them now. A view the caller still holds keeps the mapping, safely,
    until it goes."""
    try:
        mm.close()
        return True
    except BufferError:
        gc.collect()
    try:
        mm.close()
        return True
    except BufferError:
        return False


def hold_segment(name: str) -> int:
    """Take a shared lock on a segment this process owns, kept while the returned fd is
    open: what tells :func:`sweep_stale` in other processes that the owner lives."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(f"cannot open {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"cannot lock {path}: {exc}") from exc
    return fd


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments (and their indexes) of node processes that are gone;
    returns the names removed. Only this user's ``kvstore-<pid>-<hex>`` files are
    considered; one whose owner lives (or may: a lock is held) is left alone."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    uid = os.getuid()
    for name in names:
        base = name.removesuffix(_INDEX_SUFFIX)
        m = _OWNED.fullmatch(base)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue  # gone meanwhile
        if _locked(os.path.join(shm_dir, base)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(name)
    if removed:
        log.info("removed %d shared-memory segments of dead nodes: %s", len(removed), removed)
    return removed


def _path(name: str) -> str:
    if "/" in name or not name or name in (".", ".."):
        raise ConfigError(f"bad shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _locked(path: str) -> bool:
    """Whether a process holds a lock on ``path`` (False when it does not exist)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the lock if it was taken
    return False
