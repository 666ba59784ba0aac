"""Does the SSD tier move 1 MiB blocks at >= 70% of what the disk takes from plain O_DIRECT?

Anchor, measured in the same run on the same filesystem: one file written sequentially
with O_DIRECT from a page-aligned buffer, then read back with O_DIRECT. Ours:
``DiskTier.write`` of the same number of blocks (index commit included), then
``read_into`` of each (checksum verification included). Extra rows show the steady
state (extents reused after a delete), caller buffers that are not page aligned (so a
staging copy is made), and lmdb values with writemap=True, the alternative layout that
DESIGN measured. Medians of ``--runs`` runs; a ratio is the median of per-run ratios.
The page cache is dropped before each read pass when /proc/sys/vm/drop_caches is
writable (root), though O_DIRECT bypasses it anyway.

    python benchmarks/bench_ssd.py [--size-mib 1] [--blocks 256] [--runs 3] [--dir PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.blocks import BlockHeader, describe, verify_payload
from kvstore.tiers.disk import PAGE, DiskTier, extent_len

DISTINCT = 8  # distinct payloads cycled through, so no block is trivially cached


def aligned(nbytes: int) -> np.ndarray:
    """Page-aligned, already touched memory (first touch is slow and not what we time)."""
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buf.fill(1)
    return buf


def fs_type(path: Path) -> str:
    """Filesystem type of ``path`` from /proc/mounts (longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def drop_caches() -> bool:
    """Drop the page cache if we may (root); reads below are O_DIRECT regardless."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], None], nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def open_direct(path: Path, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        return os.open(path, flags, 0o600), False


def one_run(
    base: Path, size: int, n: int, src: np.ndarray, headers: list[bytes], keys: list[bytes]
) -> tuple[dict[str, float], dict[str, Any]]:
    """All measurements of one run, in GB/s of payload."""
    total = size * n
    gbs: dict[str, float] = {}
    out: Any = aligned(size)
    blocks: list[Any] = [src[(i % DISTINCT) * size : (i % DISTINCT + 1) * size] for i in range(n)]

    # anchor: plain O_DIRECT file, fresh then overwritten
    path = base / "anchor.bin"
    fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:

        def anchor_write() -> None:
            for i in range(n):
                os.pwrite(fd, blocks[i], i * size)

        def anchor_read() -> None:
            for i in range(n):
                os.preadv(fd, [out], i * size)

        gbs["anchor write"] = timed(anchor_write, total)
        dropped = drop_caches()
        gbs["anchor read"] = timed(anchor_read, total)
        gbs["anchor rewrite"] = timed(anchor_write, total)
    finally:
        os.close(fd)
        path.unlink()

    # ours: DiskTier on a fresh directory
    tier = DiskTier(base / "tier", n * extent_len(size) + PAGE)
    try:

        def ours_write(bufs: list[Any]) -> Callable[[], None]:
            def run() -> None:
                for i in range(n):
                    tier.write(keys[i], headers[i], bufs[i])

            return run

        def ours_read(dst: Any) -> Callable[[], None]:
            def run() -> None:
                for i in range(n):
                    tier.read_into(keys[i], dst)

            return run

        def clear() -> None:
            for k in keys:
                tier.delete(k)

        # each read pass follows a write pass of its data, as the anchor's does
        gbs["ours write"] = timed(ours_write(blocks), total)
        drop_caches()
        gbs["ours read"] = timed(ours_read(out), total)
        clear()
        gbs["ours rewrite"] = timed(ours_write(blocks), total)
        unaligned_out = aligned(size + 2 * PAGE)[64 : 64 + size]
        drop_caches()
        gbs["ours read, unaligned dst"] = timed(ours_read(unaligned_out), total)
        clear()
        shifted = aligned(DISTINCT * size + PAGE)[64 : 64 + DISTINCT * size]
        shifted[:] = src[: DISTINCT * size]
        unaligned = [shifted[(i % DISTINCT) * size : (i % DISTINCT + 1) * size] for i in range(n)]
        gbs["ours rewrite, unaligned src"] = timed(ours_write(unaligned), total)
        tier_direct = tier._slab.direct if tier._slab else False
    finally:
        tier.close()
        shutil.rmtree(base / "tier")

    # alternative: payload in lmdb values, writemap=True
    env = lmdb.open(
        str(base / "lmdb"),
        map_size=2 * total + (64 << 20),
        writemap=True,
        sync=False,
        metasync=False,
        readahead=False,
    )
    try:

        def lmdb_write() -> None:
            for i in range(n):
                with env.begin(write=True) as txn:
                    txn.put(keys[i], headers[i] + blocks[i].tobytes())

        def lmdb_read() -> None:
            for i in range(n):
                with env.begin(buffers=True) as txn:
                    val: Any = txn.get(keys[i])
                    hdr = BlockHeader.unpack(val[:128])
                    verify_payload(hdr, val[128:])
                    out[:] = np.frombuffer(val, dtype=np.uint8, offset=128)

        gbs["lmdb write"] = timed(lmdb_write, total)
        env.sync(True)
        env.close()
        env = lmdb.open(str(base / "lmdb"))
        drop_caches()
        gbs["lmdb read (cold)"] = timed(lmdb_read, total)
    finally:
        env.close()
        shutil.rmtree(base / "lmdb")
    return gbs, {"anchor_direct": direct, "tier_direct": tier_direct, "caches_dropped": dropped}


ROWS = [  # (label, ours, anchor)
    ("write 1 block at a time", "ours write", "anchor write"),
    ("read_into (verified)", "ours read", "anchor read"),
    ("rewrite (extents reused)", "ours rewrite", "anchor rewrite"),
    ("rewrite, unaligned src", "ours rewrite, unaligned src", "anchor rewrite"),
    ("read_into, unaligned dst", "ours read, unaligned dst", "anchor read"),
    ("lmdb values write (alt.)", "lmdb write", "anchor write"),
    ("lmdb values read (alt.)", "lmdb read (cold)", "anchor read"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=1.0, help="block payload size")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per pass")
    ap.add_argument("--runs", type=int, default=3, help="runs; medians are reported")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: cwd fs)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    size = int(args.size_mib * (1 << 20))
    n = args.blocks

    parent = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    fstype = fs_type(parent)
    if fstype in ("tmpfs", "ramfs") and args.dir is None:
        print(f"warning: {parent} is {fstype}, not a disk; pass --dir", file=sys.stderr)
    base = Path(tempfile.mkdtemp(prefix=".bench_ssd-", dir=parent))

    rng = np.random.default_rng(0)
    src = aligned(DISTINCT * size)
    src[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    headers = []
    for i, k in enumerate(keys):
        blk = src[(i % DISTINCT) * size : (i % DISTINCT + 1) * size]
        headers.append(BlockHeader.for_value(k, describe(blk), blk).pack())

    runs: list[dict[str, float]] = []
    meta: dict[str, Any] = {}
    try:
        for _ in range(args.runs):
            gbs, meta = one_run(base, size, n, src, headers, keys)
            runs.append(gbs)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = [  # the ratio is the median of per-run ratios: both sides saw the same noise
        {
            "case": label,
            "anchor_gbs": med[a],
            "ours_gbs": med[o],
            "ratio": statistics.median(r[o] / r[a] for r in runs),
        }
        for label, o, a in ROWS
    ]
    info = {
        "size_bytes": size,
        "blocks": n,
        "runs": args.runs,
        "dir": str(parent),
        "fs": fstype,
        **meta,
    }
    if args.json:
        print(json.dumps({"config": info, "rows": rows, "runs": runs}, indent=2))
        return 0
    print(
        f"SSD tier vs plain O_DIRECT file: {n} x {args.size_mib:g} MiB blocks, "
        f"median of {args.runs} runs, {parent} ({fstype}); "
        f"O_DIRECT anchor={meta['anchor_direct']} tier={meta['tier_direct']}, "
        f"page cache dropped before reads={meta['caches_dropped']}"
    )
    print(f"{'case':<28} {'anchor GB/s':>11} {'ours GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<28} {r['anchor_gbs']:>11.2f} {r['ours_gbs']:>10.2f} {r['ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
