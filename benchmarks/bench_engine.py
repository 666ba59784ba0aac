"""TTFT of a 2,048-token prompt: first 1,536 tokens from the store vs computed from scratch.

SmolLM2-135M (fp32, CPU). Both cases run through the same PrefillWorker in the same
process and run; the anchor is the from-scratch prefill. Reports wall and CPU time
medians over --runs runs, and the share of the cached TTFT spent fetching blocks.

The store is an in-process StoreNode (``--store node``, DRAM tier) or a
`kvstore serve` process reached through the client SDK (``--store server``: shared
memory on the same host).

Usage: python benchmarks/bench_engine.py [--runs 3] [--store node|server] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from contextlib import ExitStack
from typing import Any

import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.models import load_smollm2
from engine.hf.workers import PrefillWorker
from kvstore.node.store import StoreNode

PROMPT, CACHED, B = 2048, 1536, 16


def _open_store(kind: str, stack: ExitStack, ad: HFKVAdapter) -> Any:
    """An in-process node, or a `kvstore serve` child reached through StoreClient."""
    if kind == "node":
        return stack.enter_context(StoreNode(node_id="bench", dram_bytes=512 << 20))
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for tests/
    from tests.support.server_process import ALPHA, ServerProcess, base_flags

    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-engine-")))
    server = ServerProcess(work, {**base_flags(work), "dram_bytes": "512MiB"}).start()
    stack.callback(server.stop)
    return stack.enter_context(server.client(ALPHA, namespace=ad.namespace))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", choices=["node", "server"], default="node")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, _tok = load_smollm2(torch.float32)
    load_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(PROMPT)]
    ad = HFKVAdapter(model, model_id="smollm2-135m", block_tokens=B)
    keys = ad.keys(prompt)
    with ExitStack() as stack:
        store = _open_store(args.store, stack, ad)
        worker = PrefillWorker(ad, store)
        scratch, cached = [], []
        worker.prefill("warm", prompt[: CACHED + 1])  # stores blocks 0..95: the prefix
        for r in range(args.runs):
            store.remove(keys[CACHED // B :])
            assert store.match_prefix(keys) == CACHED // B
            h = worker.prefill(f"hit-{r}", prompt)
            assert h.stats.cached_blocks == CACHED // B
            cached.append(h.stats)
            store.remove(keys)
            h0 = worker.prefill(f"cold-{r}", prompt)
            assert h0.stats.cached_blocks == 0
            scratch.append(h0.stats)
            store.remove(keys[CACHED // B :])
            assert h.first_token == h0.first_token
    med = statistics.median
    res = {
        "model": "SmolLM2-135M fp32",
        "store": args.store,
        "model_load_s": load_s,
        "scratch_ttft_s": med(s.ttft_s for s in scratch),
        "scratch_cpu_s": med(s.cpu_s for s in scratch),
        "cached_ttft_s": med(s.ttft_s for s in cached),
        "cached_cpu_s": med(s.cpu_s for s in cached),
        "cached_fetch_s": med(s.fetch_s for s in cached),
        "block_bytes": ad.layout.block_bytes(),
        "blocks_fetched": CACHED // B,
    }
    res["speedup"] = res["scratch_ttft_s"] / res["cached_ttft_s"]
    res["fetch_share"] = res["cached_fetch_s"] / res["cached_ttft_s"]
    res["fetch_GBps"] = res["blocks_fetched"] * res["block_bytes"] / res["cached_fetch_s"] / 1e9
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"SmolLM2-135M fp32, {PROMPT}-token prompt, {CACHED} tokens stored, store={args.store}")
    print(f"{'':<28}{'wall':>10}{'cpu':>10}")
    print(
        f"{'TTFT from scratch (anchor)':<28}{res['scratch_ttft_s']:>9.3f}s"
        f"{res['scratch_cpu_s']:>9.3f}s"
    )
    print(f"{'TTFT with store hit':<28}{res['cached_ttft_s']:>9.3f}s{res['cached_cpu_s']:>9.3f}s")
    print(
        f"speedup {res['speedup']:.2f}x; fetching {res['blocks_fetched']} blocks "
        f"({res['block_bytes'] / 1024:.0f} KiB each) took {res['cached_fetch_s'] * 1e3:.1f} ms "
        f"= {res['fetch_share']:.1%} of TTFT ({res['fetch_GBps']:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
