"""TTFT of a PrefillWorker with its prompt's prefix fetched from a store, against recomputing.

The engine is the one ``kvstore worker --device cuda`` runs: a :class:`PrefillWorker`
over an :class:`HFKVAdapter` on ``device``. The model is a random-weight Llama of 1B
geometry (hidden 2048, 16 layers, 32 heads, 8 KV heads of 64, intermediate 8192, bf16);
the prompt has 8,192 tokens, the first 7,680 of them (480 blocks of 512 KiB) cached in
the store. In one run, alternating, after one warm-up of each:

* **cached**: the worker matches the prefix, fetches its 480 blocks as one batch into
  one device tensor, rebuilds the cache there and computes the last 512 tokens;
* **recompute**: the same worker code over a store that holds nothing, computing all
  8,192 tokens (it writes nothing either, so the cached prefix stays where it is);
* **layered** (``layer_parts`` > 0): the cached case with the prefix loaded in that many
  parts of the model's depth beside the forward (engine/hf/layerwise.py), so the fetch
  runs behind the compute of the layers already landed.

TTFT is the worker's own figure (``PrefillStats.ttft_s``: from the call to the first
token on the host), median of ``runs``. Then a handoff is checked: the decode worker,
reading the prompt's KV back from the store, yields exactly the prefill worker's own
greedy continuation (``tokens_equal``).

The store is whatever the caller gives (``address_or_store``): a ``kvstore serve``
address (a :class:`kvstore.StoreClient` is opened on it; ``client_kwargs`` go to it,
e.g. ``token=``) or an open store (a StoreClient, an in-process
:class:`~kvstore.StoreNode`). ``benchmarks/bench_gpu.py`` calls :func:`measure_ttft` with
a StoreClient of a ``kvstore serve`` on the same host.

A smoke run on a CPU, with a tiny geometry and an in-process node::

    python benchmarks/gpu_ttft.py --device cpu --store node --tiny --runs 2

On a GPU host, against a running ``kvstore serve`` (``KVSTORE_TOKEN`` in the env)::

    python benchmarks/gpu_ttft.py --device cuda --store 127.0.0.1:7400 --runs 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.blockstore import BlockStore, NodeStore, NullStore
from engine.hf.adapter import HFKVAdapter
from engine.hf.blockio import BATCH_KEYS, matched_blocks
from engine.hf.models import LLAMA_1B, LlamaGeometry, random_llama
from engine.hf.workers import DecodeWorker, PrefillWorker, greedy_continue

__all__ = ["TINY", "TTFTResult", "measure_ttft", "print_row"]

TINY = LlamaGeometry(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
"""A geometry a CPU runs in a blink: for smoke runs of this script, never for figures."""


@dataclass
class TTFTResult:
    """One measurement: medians, their samples, and the handoff check."""

    device: str
    geometry: dict[str, int]
    dtype: str
    prompt_tokens: int
    cached_tokens: int
    cached_blocks: int
    block_bytes: int
    runs: int
    cached_ttft_s: float
    recompute_ttft_s: float
    cached_fetch_s: float
    speedup: float
    """recompute TTFT / cached TTFT (the issue's target: at least 4)."""
    tokens_equal: bool
    """The decode worker's tokens equal the prefill worker's own continuation."""
    cached_samples: list[float] = field(default_factory=list)
    recompute_samples: list[float] = field(default_factory=list)
    layered_ttft_s: float | None = None
    """The cached TTFT with the prefix loaded beside the forward (``layer_parts``)."""
    layered_samples: list[float] = field(default_factory=list)


def _remove(store: Any, keys: Sequence[bytes]) -> None:
    for i in range(0, len(keys), BATCH_KEYS):
        store.remove(keys[i : i + BATCH_KEYS])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _open_store(address_or_store: Any, ad: HFKVAdapter, client_kwargs: dict[str, Any]) -> Any:
    from kvstore import StoreNode

    if isinstance(address_or_store, StoreNode):  # an engine's store: ranged reads too
        return NodeStore(address_or_store, ad.namespace), False
    if not isinstance(address_or_store, str):
        return address_or_store, False
    from kvstore import StoreClient

    kw = {"timeout_s": 60.0, "connect_timeout_s": 10.0, **client_kwargs}
    return StoreClient.connect(address_or_store, namespace=ad.namespace, **kw), True


def measure_ttft(
    device: str | torch.device,
    address_or_store: str | BlockStore | Any,
    *,
    geometry: LlamaGeometry = LLAMA_1B,
    dtype: torch.dtype = torch.bfloat16,
    prompt_tokens: int = 8192,
    cached_tokens: int = 7680,
    block_tokens: int = 16,
    runs: int = 5,
    new_tokens: int = 8,
    seed: int = 0,
    model: Any = None,
    client_kwargs: dict[str, Any] | None = None,
    layer_parts: int = 0,
) -> TTFTResult:
    """TTFT of a PrefillWorker on ``device`` with ``cached_tokens`` of the prompt in the
    store, against recomputing the whole prompt, medians of ``runs`` (module docstring).

    ``model`` (built from ``geometry`` when None) must be on ``device``. The store
    keeps the prompt's blocks afterwards only up to the cached prefix.
    """
    dev = torch.device(device)
    if cached_tokens % block_tokens or not 0 < cached_tokens < prompt_tokens:
        raise ValueError("cached_tokens: a positive multiple of block_tokens below the prompt")
    if model is None:
        model = random_llama(geometry, dtype=dtype, device=dev, seed=seed)
    ad = HFKVAdapter(model, model_id=f"random-llama-{geometry.layers}L", block_tokens=block_tokens)
    rng = random.Random(seed)
    prompt = [rng.randrange(geometry.vocab) for _ in range(prompt_tokens)]
    keys = ad.keys(prompt)
    n_cached = cached_tokens // block_tokens
    store, owned = _open_store(address_or_store, ad, client_kwargs or {})
    try:
        warm = PrefillWorker(ad, store)
        _remove(store, keys)  # a clean slate, then exactly the prefix
        _remove(store, warm.prefill("seed-prefix", prompt[: cached_tokens + 1]).scoped_keys())
        if matched_blocks(store, keys) != n_cached:
            raise RuntimeError("the store does not hold the prefix it was just given")
        workers = {"cached": warm, "recompute": PrefillWorker(ad, NullStore())}
        if layer_parts:
            workers["layered"] = PrefillWorker(ad, store, layer_parts=layer_parts)
        samples = _alternate(workers, store, prompt, keys, n_cached, runs)
        equal = _handoff_equal(ad, store, prompt, new_tokens)
        _remove(store, keys[n_cached:])
    finally:
        if owned:
            store.close()
    return _result(ad, geometry, prompt_tokens, cached_tokens, runs, samples, equal)


def _result(
    ad: HFKVAdapter,
    geometry: LlamaGeometry,
    prompt_tokens: int,
    cached_tokens: int,
    runs: int,
    samples: dict[str, list[float]],
    equal: bool,
) -> TTFTResult:
    """The medians of :func:`_alternate`'s samples, with what was measured."""
    hits, scratch = samples["cached"], samples["recompute"]
    hit, rec = statistics.median(hits), statistics.median(scratch)
    layered = samples.get("layered", [])
    return TTFTResult(
        device=str(ad.device), geometry=asdict(geometry),
        dtype=str(ad.dtype).removeprefix("torch."), prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, cached_blocks=cached_tokens // ad.block_tokens,
        block_bytes=ad.layout.block_bytes(), runs=runs, cached_ttft_s=hit,
        recompute_ttft_s=rec, cached_fetch_s=statistics.median(samples["fetch"]),
        speedup=rec / hit if hit > 0 else float("inf"), tokens_equal=equal,
        cached_samples=hits, recompute_samples=scratch,
        layered_ttft_s=statistics.median(layered) if layered else None,
        layered_samples=layered,
    )  # fmt: skip


def _alternate(
    workers: dict[str, PrefillWorker],
    store: Any,
    prompt: list[int],
    keys: Sequence[bytes],
    n_cached: int,
    runs: int,
) -> dict[str, list[float]]:
    """Each worker's TTFT samples, the workers taking turns within each run (and the
    cached worker's fetch times as ``fetch``); run 0 warms every path up (kernels, the
    allocator, the links) and is not kept. After each cached prefill the store holds
    exactly the prefix again."""
    out: dict[str, list[float]] = {name: [] for name in (*workers, "fetch")}
    dev = next(iter(workers.values())).adapter.device
    for r in range(runs + 1):
        for name, worker in workers.items():
            _sync(dev)
            h = worker.prefill(f"{name}-{r}", prompt)
            want = 0 if name == "recompute" else n_cached
            if h.stats.cached_blocks != want:
                raise RuntimeError(f"{name}: loaded {h.stats.cached_blocks} blocks, not {want}")
            if want:
                _remove(store, keys[n_cached:] + h.scoped_keys())
            if r:
                out[name].append(h.stats.ttft_s)
                if name == "cached":
                    out["fetch"].append(h.stats.fetch_s)
    return out


def _handoff_equal(ad: HFKVAdapter, store: Any, prompt: list[int], new_tokens: int) -> bool:
    """Prefill with the cached prefix, hand off through the store, decode there: the
    decode worker's tokens against the prefill worker's own continuation."""
    pw = PrefillWorker(ad, store)
    h, cache = pw.prefill_with_cache("handoff", prompt)
    own = list(greedy_continue(ad.model, cache, h.first_token, new_tokens))
    del cache
    dw = DecodeWorker(ad, store)
    got = list(dw.decode(h, new_tokens))
    _remove(store, h.scoped_keys())
    return got == own and dw.tail_recomputed == 0 and dw.first_token_mismatches == 0


def print_row(res: TTFTResult, store_name: str) -> None:
    """The ratio row, as benchmarks/RESULTS.md tables it."""
    print(
        "| measure | cached TTFT | recompute TTFT | ratio | target | tokens equal |\n"
        "|---|---|---|---|---|---|\n"
        f"| TTFT {res.prompt_tokens} tokens, {res.cached_tokens} cached ({store_name}, "
        f"{res.device}, {res.dtype}) | {res.cached_ttft_s * 1e3:.1f} ms "
        f"(fetch {res.cached_fetch_s * 1e3:.1f} ms) | {res.recompute_ttft_s * 1e3:.1f} ms | "
        f"{res.speedup:.2f}x | >= 4x | {res.tokens_equal} |"
    )
    if res.layered_ttft_s is not None:
        print(
            f"| the same, the prefix loaded beside the forward | {res.layered_ttft_s * 1e3:.1f} ms"
            f" | {res.recompute_ttft_s * 1e3:.1f} ms | "
            f"{res.recompute_ttft_s / res.layered_ttft_s:.2f}x | >= 4x | {res.tokens_equal} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--store", default="node", help="'node' (in process) or a serve address")
    ap.add_argument("--tiny", action="store_true", help="a tiny geometry (smoke runs)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--cached-tokens", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--layer-parts", type=int, default=0, help="also time a layer-wise load")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    geo = TINY if args.tiny else LLAMA_1B
    prompt = args.prompt_tokens or (256 if args.tiny else 8192)
    cached = args.cached_tokens or (prompt * 15 // 16 // 16 * 16)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.store == "node":
        from kvstore import StoreNode

        per_block = 2 * geo.layers * geo.kv_heads * 16 * geo.head_dim * dtype.itemsize
        with StoreNode(node_id="ttft", dram_bytes=2 * (prompt // 16 + 8) * per_block) as node:
            res = measure_ttft(
                args.device, node, geometry=geo, dtype=dtype, prompt_tokens=prompt,
                cached_tokens=cached, runs=args.runs, layer_parts=args.layer_parts,
            )  # fmt: skip
    else:
        res = measure_ttft(
            args.device, args.store, geometry=geo, dtype=dtype, prompt_tokens=prompt,
            cached_tokens=cached, runs=args.runs, layer_parts=args.layer_parts,
        )  # fmt: skip
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        print_row(res, "in-process node" if args.store == "node" else f"serve {args.store}")
    return 0 if res.tokens_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
