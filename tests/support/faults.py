"""Fault injection on real files: flip bytes where a tier keeps a block."""

from __future__ import annotations

from pathlib import Path


def flip_stored_bytes(root: Path, payload: bytes, at: int = 10) -> Path:
    """Find ``payload``'s first 64 bytes in any file under ``root`` and flip one byte.

    Works whatever the SSD tier's file layout is (slab file or lmdb values), so the
    tests check the behaviour, not where bytes happen to live.
    """
    needle = payload[:64]
    for f in sorted(root.rglob("*")):
        if f.is_file():
            data = bytearray(f.read_bytes())
            i = data.find(needle)
            if i >= 0:
                data[i + at] ^= 0xFF
                f.write_bytes(bytes(data))
                return f
    raise AssertionError(f"block bytes not found under {root}")
