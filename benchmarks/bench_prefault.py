"""Copies into a fresh mapping of a shared segment, with and without prefaulting it.

A same-host client maps the node's DRAM segment; its first write to each 4 KiB page of
that mapping takes a minor fault. This measures 1 MiB copies into never-touched extents
of a 2 GiB /dev/shm file (the owner has allocated every page, as a warmed node has)
through a plain mapping, and through one prefaulted the way the client does it
(kvstore/shm/prefault.py); the prefault's own time is printed beside. Medians of
``--runs``; each run uses fresh mappings.

Usage: python benchmarks/bench_prefault.py [--runs 3] [--gib 2]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from kvstore.shm.prefault import Prefaulter

MiB = 1 << 20


def copy_rate(view: np.ndarray, src: np.ndarray, copies: int) -> float:
    """GB/s of ``copies`` 1 MiB copies into extents spread over ``view``."""
    stride = (view.nbytes - MiB) // copies
    t0 = time.perf_counter()
    for i in range(copies):
        at = i * stride - (i * stride) % 4096
        np.copyto(view[at : at + MiB], src)
    return copies * MiB / (time.perf_counter() - t0) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gib", type=int, default=2)
    args = parser.parse_args()
    size = args.gib << 30
    path = f"/dev/shm/kvbench-prefault-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    src = np.random.default_rng(0).integers(0, 255, MiB, dtype=np.uint8)
    plain, faulted, populate_s = [], [], []
    try:
        os.ftruncate(fd, size)
        owner = mmap.mmap(fd, size, mmap.MAP_SHARED)
        np.frombuffer(owner, dtype=np.uint8)[::4096] = 1  # the owner allocates every page
        for _ in range(args.runs):
            m = mmap.mmap(fd, size, mmap.MAP_SHARED)
            v = np.frombuffer(m, dtype=np.uint8)
            plain.append(copy_rate(v, src, 256))
            del v
            m.close()
            m = mmap.mmap(fd, size, mmap.MAP_SHARED)
            v = np.frombuffer(m, dtype=np.uint8)
            t0 = time.perf_counter()
            Prefaulter(v.ctypes.data, size, limit=size).wait()
            populate_s.append(time.perf_counter() - t0)
            faulted.append(copy_rate(v, src, 256))
            del v
            m.close()
        owner.close()
    finally:
        os.close(fd)
        os.unlink(path)
    p, f = statistics.median(plain), statistics.median(faulted)
    print(f"1 MiB copies into fresh extents of a {args.gib} GiB segment, medians of {args.runs}:")
    print(f"  plain mapping (a fault per page)   {p:6.2f} GB/s")
    print(f"  prefaulted mapping                 {f:6.2f} GB/s   ratio {f / p:.1f}x")
    print(f"  prefault of the whole mapping      {statistics.median(populate_s):6.3f} s")


if __name__ == "__main__":
    main()
