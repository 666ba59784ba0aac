"""Named shared-memory segments: the DRAM tier's slab, mapped by the server and by
same-host clients alike."""

from __future__ import annotations

import mmap
import os

from kvstore.errors import ConfigError, StorageError

__all__ = ["SHM_DIR", "map_segment"]

SHM_DIR = "/dev/shm"


def map_segment(name: str, size: int, *, create: bool) -> mmap.mmap:
    """Create (exclusively) or open a named shared-memory segment and map it.

    Plain files under /dev/shm rather than multiprocessing.shared_memory: that
    module's resource tracker unlinks segments it did not create when a client
    process exits, which would pull a node's DRAM tier from under it.
    """
    if "/" in name or not name:
        raise ConfigError(f"bad shared-memory name {name!r}")
    path = os.path.join(SHM_DIR, name)
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
