"""Which (tenant, model) each namespace fingerprint stands for, kept as long as the blocks.

A block header carries only its namespace's 16-byte fingerprint (kvstore/blocks.py), a
hash of (model, layout, tenant). An operator selects blocks by name (``kvstore evict
--tenant``, ``kvstore ls --namespace``), so the server keeps the reverse map here. It is
fed by every scope the server resolves for a request (kvstore/server/books.py) and by the
names a drain carries with the blocks it imports (kvstore/server/maintenance.py); the admin
filters read it. One entry per namespace, never per block.

On a node with an SSD tier, whose blocks outlive the process, the map is kept beside
them in ``<ssd_path>/namespaces.jsonl`` (the SSD tier's ``LOCK`` already makes the
directory one process's), so blocks reloaded after a restart are selectable at once:

- one JSON object per line, ``{"fp": <32 hex digits>, "tenant": ..., "model": ...}``,
  appended and fsynced when a fingerprint is first seen (once per scope), read at open;
- a line counts only whole, newline included: a torn tail (a crash mid-append) or a
  corrupt line is skipped with a warning, and a file that had any is rewritten clean
  (temp file, fsync, rename) before anything is appended to it;
- a failed append (disk full, I/O error) is logged, and that entry and later ones are
  kept in memory only: it costs admin filters their precision after the next restart,
  never a request;
- at most ``max_persisted`` entries go to disk (a bound on what a tenant inventing
  model names can make the server write); later ones stay in memory, with one warning.

Without an SSD tier the map is in memory only, like the blocks it names.

Concurrency: ``_lock`` guards the map and is never held across I/O; ``_io_lock``
guards the file handle and the append count, and serializes appends and ``close``. No
thread holds both.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from kvstore.errors import InvalidValue, LimitExceeded, StorageError
from kvstore.keys import KEY_BYTES

__all__ = ["FILE_NAME", "MAX_PERSISTED", "NamespaceRegistry"]

log = logging.getLogger(__name__)

FILE_NAME = "namespaces.jsonl"
MAX_PERSISTED = 1 << 16
Names = tuple[str, str]  # (tenant, model)


class NamespaceRegistry:
    """Namespace fingerprint -> (tenant, model); persisted when given a directory.

    :meth:`open` is the constructor for a server: a directory (the SSD tier's) or
    nothing (memory only). ``NamespaceRegistry()`` is the in-memory one.
    """

    def __init__(self, path: Path | None = None, *, max_persisted: int = MAX_PERSISTED) -> None:
        self.path = path
        self.max_persisted = max_persisted
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._names: dict[bytes, Names] = {}
        self._fd: int | None = None
        self._persisted = 0  # lines in the file
        self._warned_full = False
        if path is not None:
            self._open_file(path)

    @classmethod
    def open(cls, directory: str | os.PathLike[str] | None) -> NamespaceRegistry:
        """The registry kept in ``directory`` (created by the SSD tier), or an in-memory
        one when ``directory`` is empty or None. StorageError if the file cannot be
        opened; unreadable lines in it are skipped, never an error."""
        if not directory:
            return cls()
        return cls(Path(directory) / FILE_NAME)

    # -- reads ---------------------------------------------------------------------------

    def get(self, fingerprint: bytes) -> Names | None:
        """(tenant, model) of a fingerprint, or None when it is not known."""
        with self._lock:
            return self._names.get(bytes(fingerprint))

    def select(self, tenant: str = "", model: str = "") -> frozenset[bytes]:
        """Fingerprints of the namespaces of a tenant and/or model ("" any)."""
        with self._lock:
            return frozenset(
                fp
                for fp, (t, m) in self._names.items()
                if (not tenant or t == tenant) and (not model or m == model)
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)

    # -- writes --------------------------------------------------------------------------

    def add(self, fingerprint: bytes, tenant: str, model: str, *, limit: int = 0) -> bool:
        """Record a namespace; True when it was new (and, with a file, appended to it).

        A fingerprint keeps the names it was first recorded with: it is a hash of them,
        so a second pair of names for it is an impossibility, not an update. With
        ``limit``, a tenant that already has that many namespaces gets LimitExceeded for
        a new one (namespaces known from earlier runs count): every tenant's share of the
        registry, in memory and on disk, stays bounded."""
        fp = bytes(fingerprint)
        if len(fp) != KEY_BYTES:
            raise InvalidValue(f"a namespace fingerprint is {KEY_BYTES} bytes, got {len(fp)}")
        if not tenant or not model:
            raise InvalidValue("a namespace needs both a tenant and a model")
        with self._lock:
            if fp in self._names:
                return False
            if limit and sum(1 for t, _ in self._names.values() if t == tenant) >= limit:
                raise LimitExceeded(
                    f"tenant {tenant!r} already has {limit} namespaces, the server's limit "
                    "(max_namespaces_per_tenant)"
                )
            self._names[fp] = (tenant, model)
        if self.path is not None:
            self._append(fp, (tenant, model))
        return True

    def close(self) -> None:
        """Close the file (idempotent); the map stays usable, in memory only."""
        with self._io_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # -- the file ------------------------------------------------------------------------

    def _open_file(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries, clean = _load(path)
            if not clean:
                _rewrite(path, entries)
            existed = path.exists()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if not existed:
                _fsync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"namespace registry {path}: {exc}") from exc
        self._names.update(entries)
        self._persisted = len(entries)
        if entries:
            log.info("%s: %d namespaces known from earlier runs", path, len(entries))

    def _append(self, fp: bytes, names: Names) -> None:
        line = _encode(fp, names)
        with self._io_lock:
            if self._fd is None:  # closed, or broken by a failed write: memory only
                return
            if self._persisted >= self.max_persisted:
                if not self._warned_full:
                    self._warned_full = True
                    log.warning(
                        "%s holds %d namespaces, its limit; newer ones are kept in memory "
                        "only (admin filters miss their blocks after a restart)",
                        self.path,
                        self._persisted,
                    )
                return
            try:
                _write_all(self._fd, line)
                os.fsync(self._fd)
            except OSError as exc:
                # Part of the line may be on disk: appending more would glue the next
                # line to it, so this run stops writing; the next open drops the piece.
                log.warning(
                    "%s: cannot record namespace %s (%s); namespaces seen from now on "
                    "are kept in memory only",
                    self.path,
                    fp.hex(),
                    exc,
                )
                os.close(self._fd)
                self._fd = None
                return
            self._persisted += 1


def _encode(fp: bytes, names: Names) -> bytes:
    doc = {"fp": fp.hex(), "tenant": names[0], "model": names[1]}
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _decode(line: bytes) -> tuple[bytes, Names] | None:
    try:
        doc = json.loads(line)
        fp = bytes.fromhex(doc["fp"])
        tenant, model = doc["tenant"], doc["model"]
    except (ValueError, TypeError, KeyError):  # JSON and UTF-8 errors are ValueErrors
        return None
    if len(fp) != KEY_BYTES or not isinstance(tenant, str) or not isinstance(model, str):
        return None
    if not tenant or not model:
        return None
    return fp, (tenant, model)


def _load(path: Path) -> tuple[dict[bytes, Names], bool]:
    """The entries of a registry file, and whether every line in it was whole and good
    (a missing file is an empty, clean one)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, True
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else a torn last line
    bad = 1 if tail else 0
    entries: dict[bytes, Names] = {}
    for line in lines:
        entry = _decode(line)
        if entry is None or entry[0] in entries:
            bad += 1
            continue
        entries[entry[0]] = entry[1]
    if bad:
        log.warning(
            "%s: skipped %d unreadable line(s) (a write cut short?); rewriting it with the "
            "%d good ones",
            path,
            bad,
            len(entries),
        )
    return entries, not bad


def _rewrite(path: Path, entries: dict[bytes, Names]) -> None:
    """Replace the file with ``entries``: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, b"".join(_encode(fp, names) for fp, names in entries.items()))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
