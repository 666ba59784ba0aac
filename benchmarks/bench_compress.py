"""KV compression (fp8 e4m3, int8): bytes saved, codec speed, quality, TTFT over TCP.

SmolLM2-135M's real weights (``--dtype``, fp32 by default: the CPU engine's dtype), on
CPU, every number measured in one run against an anchor from the same run:

* **Bytes and speed.** A stored block of each namespace (uncompressed, fp8, int8), and
  encode / decode GB/s over the real KV blocks of the TTFT prompt, counted in the
  engine's bytes, beside a plain torch copy of the same bytes (the ratio is printed):
  encode block by block, as puts do; decode the whole prefix in one call, as
  ``HFKVAdapter.load_prefix`` does.
* **Greedy agreement.** ``--prompts`` prompts of ``--prompt-tokens`` tokens (windows of
  the docstrings of Python's standard library: real text, offline, fixed per Python
  version). Each prompt's full blocks are stored in a real StoreNode under each
  namespace; the prompt is then prefilled with its prefix loaded from the store and
  continued greedily for ``--new-tokens`` tokens (all prompts batched). Compared with
  the uncompressed prefix (bit-exact KV): prompts whose tokens all agree, tokens until
  the first difference, and the share of positions that agree.
* **Perplexity.** ``--ppl-windows`` windows of fixed text: ``--ppl-prefix`` tokens of KV
  from the store, the next ``--ppl-tokens`` scored; perplexity per namespace.
* **TTFT over TCP.** A real ``kvstore serve`` on 127.0.0.1, the client on transport tcp.
  A ``--ttft-tokens`` prompt whose full blocks are stored: TTFT = fetch the prefix
  (and decode it) + prefill the rest + the first token, medians of ``--runs``, beside
  the same prompt computed from scratch.

Usage: python benchmarks/bench_compress.py [--runs 3] [--prompts 50] [--new-tokens 64]
       [--dtype fp32|bf16] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.models import load_smollm2
from kvstore import StoreClient, StoreNode

B = 16
CODECS = ("none", "fp8", "int8")
TOKEN = "bench-compress-token-0123456789"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Standard-library modules whose docstrings make the text (sorted names keep it fixed).
MODULES = [
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "doctest",
    "email",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "glob",
    "hashlib",
    "heapq",
    "hmac",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mimetypes",
    "numbers",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unittest",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
]
med = statistics.median


# -- text and model ----------------------------------------------------------------------


def corpus() -> list[str]:
    """Docstrings of the standard library: each module's, then its long public ones."""
    parts = []
    for name in MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", "") != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj) or ""
                if len(doc) > 200:
                    parts.append(doc)
    return [p for p in parts if p]


def texts(tok: Any, n_prompts: int, prompt_len: int, ppl_windows: int, ppl_len: int) -> Any:
    """(prompts, perplexity windows, a long prompt): disjoint token windows of the corpus."""
    docs = [tok.encode(p) for p in corpus()]
    long = [d for d in docs if len(d) >= prompt_len]
    if len(long) < n_prompts:
        raise SystemExit(f"only {len(long)} texts of {prompt_len} tokens; ask for fewer")
    step = len(long) / n_prompts
    picked = {int(i * step) for i in range(n_prompts)}
    prompts = [long[i][:prompt_len] for i in sorted(picked)]
    rest = [t for i, d in enumerate(long) if i not in picked for t in d]
    windows = [rest[i * ppl_len : (i + 1) * ppl_len] for i in range(ppl_windows)]
    stream = rest[ppl_windows * ppl_len :]
    return prompts, windows, stream


def adapters(model: Any) -> dict[str, HFKVAdapter]:
    return {
        c: HFKVAdapter(
            model, model_id="smollm2-135m", block_tokens=B, kv_codec=None if c == "none" else c
        )
        for c in CODECS
    }


@torch.inference_mode()
def store_prefix(ads: dict[str, HFKVAdapter], store: Any, ids: Sequence[int], n: int) -> Any:
    """Compute the first ``n`` blocks of ``ids`` once and put them in every namespace;
    returns the computed cache."""
    model = next(iter(ads.values())).model
    out = model(torch.tensor([list(ids[: n * B])]), use_cache=True)
    for ad in ads.values():
        ad.store_blocks(store, ad.keys(ids)[:n], out.past_key_values, 0)
    return out.past_key_values


def load_batched(ad: HFKVAdapter, store: Any, prompts: Sequence[Sequence[int]], n: int) -> Any:
    """One DynamicCache of batch ``len(prompts)`` from each prompt's first ``n`` stored
    blocks (read, verified and decoded by the adapter, one block at a time)."""
    from transformers import DynamicCache

    layers, _, heads, _, dim = ad.block_shape
    buf = torch.empty((len(prompts), n, *ad.block_shape), dtype=ad.dtype)
    for i, ids in enumerate(prompts):
        for j, key in enumerate(ad.keys(ids)[:n]):
            if not ad.get_block(store, key, buf[i, j]):
                raise RuntimeError(f"block {j} of prompt {i} missing from {ad.namespace.layout}")
    data = []
    for li in range(layers):
        k, v = (buf[:, :, li, kv].permute(0, 2, 1, 3, 4) for kv in (0, 1))
        shape = (len(prompts), heads, n * B, dim)
        data.append((k.reshape(shape).contiguous(), v.reshape(shape).contiguous()))
    return DynamicCache(ddp_cache_data=data, config=ad.model.config)


# -- measurements --------------------------------------------------------------------------


def timed_together(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, measured in turns (one call of each per run,
    after one warm-up round), so a busy moment on a shared machine slows all of them."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(runs + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: med(v) for k, v in times.items()}


def _each_block(
    fn: Callable[[torch.Tensor, torch.Tensor], Any], blocks: list[torch.Tensor]
) -> Callable[[], None]:
    """``fn(block, out)`` over ``blocks``, each with its own output tensor."""
    outs = [torch.empty_like(b) for b in blocks]

    def run() -> None:
        for b, o in zip(blocks, outs, strict=True):
            fn(b, o)

    return run


def _encode_one(codec: Any, block: torch.Tensor, _out: torch.Tensor) -> None:
    codec.encode(block)


def codec_speed(ads: dict[str, HFKVAdapter], blocks: list[torch.Tensor], runs: int) -> dict:
    """Encode GB/s block by block (as puts encode) and decode GB/s of the whole prefix
    in one call (as HFKVAdapter.load_prefix decodes), in engine bytes, each beside a
    torch copy of the same bytes in the same pattern."""
    nbytes = sum(b.numel() * b.element_size() for b in blocks)
    stack = torch.stack(blocks)
    stack_out = torch.empty_like(stack)
    fns: dict[str, Callable[[], Any]] = {
        "encode_copy": _each_block(lambda b, o: o.copy_(b), blocks),
        "decode_copy": lambda: stack_out.copy_(stack),
    }
    for name in CODECS[1:]:
        codec: Any = ads[name].codec
        encoded = codec.encode(stack)
        fns[f"{name}_encode"] = _each_block(partial(_encode_one, codec), blocks)
        fns[f"{name}_decode"] = partial(codec.decode, encoded, stack_out)
    secs = timed_together(fns, runs)
    res: dict[str, Any] = {"bytes": nbytes, "runs": runs}
    res["encode_copy_GBps"] = nbytes / secs["encode_copy"] / 1e9
    res["decode_copy_GBps"] = nbytes / secs["decode_copy"] / 1e9
    for name in CODECS[1:]:
        res[name] = {
            f"{op}_GBps": nbytes / secs[f"{name}_{op}"] / 1e9 for op in ("encode", "decode")
        }
    return res


@torch.inference_mode()
def greedy_batch(model: Any, cache: Any, suffix: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy tokens per row after ``suffix`` (``[batch, s]``) on ``cache``."""
    out = model(suffix, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1].argmax(-1)
    toks = [tok]
    for _ in range(steps - 1):
        out = model(tok[:, None], past_key_values=out.past_key_values, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        toks.append(tok)
    return torch.stack(toks, 1)


def agreement(ads: dict[str, HFKVAdapter], prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy continuations from each namespace's stored prefix vs the uncompressed one."""
    model = ads["none"].model
    n = ads["none"].reusable_blocks(len(prompts[0]), len(prompts[0]) // B)
    suffix = torch.tensor([p[n * B :] for p in prompts])
    res: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": len(prompts[0])}
    res["cached_tokens"], res["new_tokens"] = n * B, new_tokens
    with StoreNode(node_id="bench-quality", dram_bytes=2 << 30) as node:
        for p in prompts:
            store_prefix(ads, node, p, n)
        toks = {
            c: greedy_batch(model, load_batched(ads[c], node, prompts, n), suffix, new_tokens)
            for c in CODECS
        }
    ref = toks["none"]
    for c in CODECS[1:]:
        same = toks[c] == ref
        first_diff = torch.where(same.all(1), new_tokens, (~same).int().argmax(1))
        res[c] = {
            "exact_prompts": int(same.all(1).sum()),
            "first_token_agree": int(same[:, 0].sum()),
            "tokens_to_first_diff": float(first_diff.float().mean()),
            "position_agreement": float(same.float().mean()),
        }
    return res


@torch.inference_mode()
def perplexity(ads: dict[str, HFKVAdapter], windows: list[list[int]], prefix: int) -> dict:
    """Perplexity of each window's tokens after ``prefix`` given its stored prefix KV."""
    model = ads["none"].model
    n = prefix // B
    scored = torch.tensor([w[n * B :] for w in windows])
    res: dict[str, Any] = {"windows": len(windows), "prefix": n * B, "scored": scored.shape[1]}
    with StoreNode(node_id="bench-ppl", dram_bytes=1 << 30) as node:
        for w in windows:
            store_prefix(ads, node, w, n)
        for c in CODECS:
            cache = load_batched(ads[c], node, windows, n)
            logits = model(scored, past_key_values=cache, use_cache=True).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), scored[:, 1:].reshape(-1)
            )
            res[c] = {"ppl": float(torch.exp(nll))}
    for c in CODECS[1:]:
        res[c]["change"] = res[c]["ppl"] / res["none"]["ppl"] - 1
    return res


@contextmanager
def kvstore_serve(dram: str) -> Iterator[dict[str, Any]]:
    """A real ``kvstore serve`` on free loopback ports; stopped by PID at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_AUTH_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "kvstore.cli", "serve", "--json", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--data-port", "0", "--dram-bytes", dram]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"kvstore serve exited ({proc.wait(10)}) before it was ready")
        yield json.loads(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@torch.inference_mode()
def ttft_tcp(
    ads: dict[str, HFKVAdapter], ids: list[int], runs: int
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """TTFT with each namespace's prefix fetched over TCP from ``kvstore serve``, and
    from scratch; also returns the prefix's blocks (for :func:`codec_speed`)."""
    model = ads["none"].model
    n = ads["none"].reusable_blocks(len(ids), len(ids) // B)
    x = torch.tensor([ids])
    fetch: dict[str, list[float]] = {c: [] for c in CODECS}
    ttft: dict[str, list[float]] = {c: [] for c in (*CODECS, "scratch")}
    first: dict[str, int] = {}
    with kvstore_serve("1GiB") as facts:
        addr = f"127.0.0.1:{facts['port']}"
        with StoreClient.connect(addr, token=TOKEN, transport="tcp") as client:
            cache = store_prefix(ads, client, ids, n)
            blocks = ads["none"].blocks_from_cache(cache, 0, n)
            for r in range(runs + 1):  # round 0 warms the connection and caches up
                for c in CODECS:
                    ad = ads[c]
                    t0 = time.perf_counter()
                    got, cache = ad.load_prefix(client, ad.keys(ids), len(ids))
                    t1 = time.perf_counter()
                    out = model(x[:, got * B :], past_key_values=cache, use_cache=True)
                    first[c] = int(out.logits[0, -1].argmax())
                    assert got == n, f"{c}: {got} of {n} blocks"
                    if r:
                        fetch[c].append(t1 - t0)
                        ttft[c].append(time.perf_counter() - t0)
                if r:  # one big forward: nothing to warm
                    t0 = time.perf_counter()
                    first["scratch"] = int(model(x, use_cache=True).logits[0, -1].argmax())
                    ttft["scratch"].append(time.perf_counter() - t0)
            transport = client.transport
    res: dict[str, Any] = {"prompt_tokens": len(ids), "cached_tokens": n * B, "runs": runs}
    res["transport"] = transport
    for c in ttft:
        res[c] = {"ttft_s": med(ttft[c]), "first_token": first[c]}
        if c in fetch:
            res[c]["fetch_s"] = med(fetch[c])
            res[c]["wire_bytes"] = n * ads[c].stored_block_bytes
    return res, blocks


# -- report ----------------------------------------------------------------------------


def _row(label: str, cells: Sequence[str]) -> None:
    print(f"{label:<34}" + "".join(f"{c:>16}" for c in cells))


def _per_codec(fmt: Callable[[str], str], ref: str = "(ref)") -> list[str]:
    return [ref, *(fmt(c) for c in CODECS[1:])]


def print_report(r: dict[str, Any]) -> None:
    sp, q, p, t = r["speed"], r["agreement"], r["perplexity"], r["ttft"]
    size = r["block_bytes"]
    print(
        f"SmolLM2-135M {r['dtype']}, CPU, {r['threads']} torch threads; a block is "
        f"[{r['block_shape']}]\n"
    )
    _row("", CODECS)
    _row("stored bytes per block", [f"{size[c]:,}" for c in CODECS])
    _row("bytes saved", _per_codec(lambda c: f"{1 - size[c] / size['none']:.1%}", "-"))
    for op, how in (("encode", "per block"), ("decode", "per prefix")):
        copy = sp[f"{op}_copy_GBps"]
        rates = [sp[c][f"{op}_GBps"] for c in CODECS[1:]]
        _row(
            f"{op} GB/s {how} (x copy)",
            [f"copy {copy:.2f}"] + [f"{g:.2f} ({g / copy:.2f}x)" for g in rates],
        )
    n = q["prompts"]
    print(
        f"greedy agreement: {n} prompts of {q['prompt_tokens']} tokens "
        f"({q['cached_tokens']} from the store), {q['new_tokens']} new tokens each"
    )
    _row("  prompts with every token equal", _per_codec(lambda c: f"{q[c]['exact_prompts']}/{n}"))
    _row("  first token equal", _per_codec(lambda c: f"{q[c]['first_token_agree']}/{n}"))
    _row(
        "  tokens to first difference", _per_codec(lambda c: f"{q[c]['tokens_to_first_diff']:.1f}")
    )
    _row("  positions equal", _per_codec(lambda c: f"{q[c]['position_agreement']:.1%}"))
    print(
        f"perplexity: {p['windows']} windows, {p['prefix']} tokens of KV from the store, "
        f"{p['scored']} scored"
    )
    _row(
        "  perplexity (change)",
        _per_codec(
            lambda c: f"{p[c]['ppl']:.3f} ({p[c]['change']:+.2%})", f"{p['none']['ppl']:.3f}"
        ),
    )
    print(
        f"TTFT over {t['transport']} (kvstore serve on 127.0.0.1): {t['prompt_tokens']}-token "
        f"prompt, {t['cached_tokens']} from the store, median of {t['runs']}; "
        f"from scratch {t['scratch']['ttft_s'] * 1e3:.0f} ms"
    )
    _row("  bytes fetched", [f"{t[c]['wire_bytes'] / 2**20:.1f} MiB" for c in CODECS])
    _row("  fetch + decode ms", [f"{t[c]['fetch_s'] * 1e3:.1f}" for c in CODECS])
    _row("  TTFT ms", [f"{t[c]['ttft_s'] * 1e3:.1f}" for c in CODECS])
    same = [str(t[c]["first_token"] == t["scratch"]["first_token"]) for c in CODECS]
    _row("  first token = scratch's", same)
    took = ", ".join(f"{k} {v:.0f} s" for k, v in r["section_s"].items())
    print(f"\ntotal {r['elapsed_s']:.0f} s (model load {r['load_s']:.0f} s, {took})")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--runs", type=int, default=3, help="runs per timing (medians)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-tokens", type=int, default=136, help="of which full blocks cached")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-prefix", type=int, default=256, help="tokens of KV from the store")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="tokens scored after it")
    ap.add_argument("--ttft-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = load_smollm2(DTYPES[args.dtype])
    load_s = time.perf_counter() - t0
    ads = adapters(model)
    ppl_len = args.ppl_prefix + args.ppl_tokens
    prompts, windows, stream = texts(
        tok, args.prompts, args.prompt_tokens, args.ppl_windows, ppl_len
    )
    if len(stream) < args.ttft_tokens:
        raise SystemExit(f"only {len(stream)} tokens of text left for the TTFT prompt")
    sections: dict[str, float] = {}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            sections[name] = time.perf_counter() - start

    ttft, blocks = section("ttft", lambda: ttft_tcp(ads, stream[: args.ttft_tokens], args.runs))
    report = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "block_shape": ", ".join(map(str, ads["none"].block_shape)),
        "block_bytes": {c: ads[c].stored_block_bytes for c in CODECS},
        "speed": section("speed", lambda: codec_speed(ads, blocks, max(args.runs, 9))),
        "agreement": section("agreement", lambda: agreement(ads, prompts, args.new_tokens)),
        "perplexity": section("perplexity", lambda: perplexity(ads, windows, args.ppl_prefix)),
        "ttft": ttft,
        "load_s": load_s,
        "section_s": sections,
    }
    report["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
