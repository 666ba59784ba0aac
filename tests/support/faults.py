"""Fault injection on real files: flip bytes where a tier keeps a block."""

from __future__ import annotations

from pathlib import Path


def flip_stored_bytes(root: Path, payload: bytes, at: int = 10) -> Path:
    """Find ``payload``'s first 64 bytes in the files under ``root`` and flip one byte of
    every copy found.

    Works whatever the SSD tier's file layout is (slab file or lmdb values), so the
    tests check the behaviour, not where bytes happen to live. Every copy, because a
    tier may also hold stale ones (a slot freed by an earlier move and not yet
    overwritten), and flipping only the first found could miss the live one. Returns
    the first file changed.
    """
    needle = payload[:64]
    changed: list[Path] = []
    for f in sorted(root.rglob("*")):
        if f.is_file():
            data = bytearray(f.read_bytes())
            i = data.find(needle)
            if i < 0:
                continue
            while i >= 0:
                data[i + at] ^= 0xFF
                i = data.find(needle, i + 1)
            f.write_bytes(bytes(data))
            changed.append(f)
    if not changed:
        raise AssertionError(f"block bytes not found under {root}")
    return changed[0]
