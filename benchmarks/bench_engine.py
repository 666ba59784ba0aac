"""TTFT of a 2,048-token prompt: first 1,536 tokens from the store vs computed from scratch.

SmolLM2-135M (fp32, CPU). Both cases run through the same PrefillWorker in the same
process and run; the anchor is the from-scratch prefill. Reports wall and CPU time
medians over --runs runs, and the share of the cached TTFT spent fetching blocks.

The store is an in-process StoreNode (``--store node``, DRAM tier) or a
`kvstore serve` process reached through the client SDK (``--store server``: shared
memory on the same host).

``--layer-parts N`` times a third case beside them: the prefix loaded in N parts of the
model's depth while the forward runs (engine/hf/layerwise.py), anchored on the same
run's fetch-first prefill and from-scratch prefill.

Usage: python benchmarks/bench_engine.py [--runs 3] [--store node|server]
       [--transport auto|shm|tcp] [--layer-parts N] [--json]
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
from engine.hf.workers import PrefillStats, PrefillWorker
from kvstore.node.store import StoreNode

PROMPT, CACHED, B = 2048, 1536, 16


def _open_store(kind: str, stack: ExitStack, ad: HFKVAdapter, transport: str) -> Any:
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
    return stack.enter_context(server.client(ALPHA, namespace=ad.namespace, transport=transport))


def _measure(
    workers: dict[str, PrefillWorker], store: Any, prompt: list[int], runs: int
) -> dict[str, list[PrefillStats]]:
    """Per mode, each run's PrefillStats: the cached modes with exactly the prefix
    stored, then ``scratch`` (nothing stored). Every mode's first token must agree."""
    ad = next(iter(workers.values())).adapter
    keys = ad.keys(prompt)
    out: dict[str, list[PrefillStats]] = {m: [] for m in (*workers, "scratch")}
    for r in range(runs):
        firsts = set()
        for mode, worker in workers.items():
            store.remove(keys[CACHED // B :])
            assert store.match_prefix(keys) == CACHED // B
            h = worker.prefill(f"{mode}-{r}", prompt)
            assert h.stats.cached_blocks == CACHED // B, (mode, h.stats)
            out[mode].append(h.stats)
            firsts.add(h.first_token)
        store.remove(keys)
        h0 = next(iter(workers.values())).prefill(f"cold-{r}", prompt)
        assert h0.stats.cached_blocks == 0
        out["scratch"].append(h0.stats)
        firsts.add(h0.first_token)
        assert len(firsts) == 1, firsts
        store.remove(keys[CACHED // B :])
    return out


def _report(res: dict[str, Any]) -> None:
    print(
        f"SmolLM2-135M fp32, {PROMPT}-token prompt, {CACHED} tokens stored, "
        f"store={res['store']} ({res['transport']}), {res['threads']} torch threads"
    )
    print(f"{'':<40}{'wall':>10}{'cpu':>10}")
    for mode, label in (
        ("scratch", "TTFT from scratch (anchor)"),
        ("whole", "TTFT, prefix fetched first"),
        ("layered", f"TTFT, prefix in {res['layer_parts']} parts beside it"),
    ):
        if mode in res["ttft_s"]:
            print(f"{label:<40}{res['ttft_s'][mode]:>9.3f}s{res['cpu_s'][mode]:>9.3f}s")
    print(
        f"speedup over scratch {res['speedup']:.2f}x (fetched first); fetching "
        f"{res['blocks_fetched']} blocks ({res['block_bytes'] / 1024:.0f} KiB each) took "
        f"{res['fetch_s'] * 1e3:.1f} ms = {res['fetch_share']:.1%} of that TTFT "
        f"({res['fetch_GBps']:.2f} GB/s)"
    )
    if "layered" in res["ttft_s"]:
        print(
            f"layered vs fetched first: {res['ttft_s']['whole'] / res['ttft_s']['layered']:.2f}x;"
            f" over scratch {res['ttft_s']['scratch'] / res['ttft_s']['layered']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", choices=["node", "server"], default="node")
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument("--layer-parts", type=int, default=0, help="also time a layer-wise load")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, _tok = load_smollm2(torch.float32)
    load_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(PROMPT)]
    ad = HFKVAdapter(model, model_id="smollm2-135m", block_tokens=B)
    with ExitStack() as stack:
        store = _open_store(args.store, stack, ad, args.transport)
        workers = {"whole": PrefillWorker(ad, store)}
        if args.layer_parts:
            workers["layered"] = PrefillWorker(ad, store, layer_parts=args.layer_parts)
        workers["whole"].prefill("warm", prompt[: CACHED + 1])  # stores the prefix's blocks
        stats = _measure(workers, store, prompt, args.runs)
    med = statistics.median
    res: dict[str, Any] = {
        "model": "SmolLM2-135M fp32", "store": args.store, "transport": args.transport,
        "threads": torch.get_num_threads(), "layer_parts": args.layer_parts,
        "model_load_s": load_s, "block_bytes": ad.layout.block_bytes(),
        "blocks_fetched": CACHED // B,
        "ttft_s": {m: med(s.ttft_s for s in v) for m, v in stats.items()},
        "cpu_s": {m: med(s.cpu_s for s in v) for m, v in stats.items()},
        "fetch_s": med(s.fetch_s for s in stats["whole"]),
    }  # fmt: skip
    res["speedup"] = res["ttft_s"]["scratch"] / res["ttft_s"]["whole"]
    res["fetch_share"] = res["fetch_s"] / res["ttft_s"]["whole"]
    res["fetch_GBps"] = res["blocks_fetched"] * res["block_bytes"] / res["fetch_s"] / 1e9
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _report(res)


if __name__ == "__main__":
    main()
