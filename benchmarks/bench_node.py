"""In-process node throughput against numpy memcpy, and prefix_keys throughput.

Questions answered, each with its anchor measured in the same run:
- get_into of 1 MiB / 4 MiB blocks from the DRAM tier vs a numpy copy of the same
  bytes with the same access pattern (N distinct slab regions -> one output buffer);
  target >= 50%.
- put of 1 MiB / 4 MiB blocks (checksum + copy + index) vs a numpy copy of one source
  into N distinct slab regions; target >= 40%.
- prefix_keys tokens/s at block sizes 16 and 256 vs one BLAKE2b call over the same
  bytes (the hash's own speed: the ceiling); target >= 10M tokens/s at 16.

Usage: python benchmarks/bench_node.py [--runs 5] [--blocks 64] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvstore.keys import Namespace, prefix_keys
from kvstore.node.store import StoreNode


def _median_rate(fn: Callable[[], None], nbytes: int, runs: int) -> float:
    fn()  # warm-up: page faults, allocator, caches
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_blocks(size: int, blocks: int, runs: int) -> dict[str, float]:
    """Anchor and ours for put and get_into of ``blocks`` blocks of ``size`` bytes."""
    total = size * blocks
    slab = np.zeros(total + size, dtype=np.uint8)
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)

    def memcpy_put() -> None:
        for i in range(blocks):
            np.copyto(slab[i * size : (i + 1) * size], src)

    def memcpy_get() -> None:
        for i in range(blocks):
            np.copyto(out, slab[i * size : (i + 1) * size])

    value = torch.from_numpy(src.view(np.float32).copy())
    out_t = torch.empty_like(value)
    rounds = runs + 1  # the warm-up round needs its own keys too
    key_sets = [
        [(r * blocks + i).to_bytes(16, "little") for i in range(blocks)] for r in range(rounds)
    ]
    fresh = iter(key_sets)
    with StoreNode(node_id="bench", dram_bytes=(size + 4096) * blocks * rounds) as node:

        def our_put() -> None:  # fresh keys every round: no eviction, no dedupe
            for k in next(fresh):
                node.put(k, value)

        keys = key_sets[0]

        def our_get() -> None:
            for k in keys:
                if not node.get_into(k, out_t):
                    raise RuntimeError("miss in benchmark")

        anchor_put = _median_rate(memcpy_put, total, runs)
        ours_put = _median_rate(our_put, total, runs)
        anchor_get = _median_rate(memcpy_get, total, runs)
        ours_get = _median_rate(our_get, total, runs)
    return {
        "put_anchor_GBps": anchor_put / 1e9,
        "put_ours_GBps": ours_put / 1e9,
        "put_ratio": ours_put / anchor_put,
        "get_into_anchor_GBps": anchor_get / 1e9,
        "get_into_ours_GBps": ours_get / 1e9,
        "get_into_ratio": ours_get / anchor_get,
    }


def bench_keys(block_tokens: int, runs: int, n_tokens: int = 1 << 20) -> dict[str, float]:
    """prefix_keys tokens/s on a numpy prompt and on a Python list, vs raw BLAKE2b."""
    ns = Namespace("llama-3-8b", "bf16:L32:H8:D128")
    toks = np.random.default_rng(1).integers(0, 128_000, n_tokens, dtype=np.int64)
    as_list = toks.tolist()
    raw = toks.astype("<u4").tobytes()

    def rate(fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            samples.append(n_tokens / (time.perf_counter() - t0))
        return statistics.median(samples)

    anchor = rate(lambda: hashlib.blake2b(raw, digest_size=16).digest())
    ours = rate(lambda: prefix_keys(toks, block_tokens, ns))
    ours_list = rate(lambda: prefix_keys(as_list, block_tokens, ns))
    return {
        "anchor_Mtok_s": anchor / 1e6,
        "ours_numpy_Mtok_s": ours / 1e6,
        "ours_list_Mtok_s": ours_list / 1e6,
        "ratio": ours / anchor,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for mib in (1, 4):
        results[f"node_{mib}MiB"] = bench_blocks(mib << 20, max(args.blocks // mib, 8), args.runs)
    for b in (16, 256):
        results[f"prefix_keys_B{b}"] = bench_keys(b, args.runs)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'case':<22}{'anchor':>14}{'ours':>14}{'ratio':>8}")
    for mib in (1, 4):
        r = results[f"node_{mib}MiB"]
        for op in ("put", "get_into"):
            print(
                f"{op + f' {mib} MiB':<22}{r[f'{op}_anchor_GBps']:>10.1f} GB/s"
                f"{r[f'{op}_ours_GBps']:>10.1f} GB/s{r[f'{op}_ratio']:>8.0%}"
            )
    for b in (16, 256):
        r = results[f"prefix_keys_B{b}"]
        print(
            f"{f'prefix_keys B={b}':<22}{r['anchor_Mtok_s']:>9.1f} Mtok/s"
            f"{r['ours_numpy_Mtok_s']:>9.1f} Mtok/s{r['ratio']:>8.0%}"
            f"   (list input: {r['ours_list_Mtok_s']:.1f} Mtok/s)"
        )
    print("anchor: numpy copyto of the same bytes / one BLAKE2b call over the same tokens")


if __name__ == "__main__":
    main()
