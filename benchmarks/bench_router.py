"""Live replay of a conversation-trace slice through the router, per placement policy.

Question: does the cache-aware router beat the cache-blind ones on a real serving
stack (TTFT p50/p99, goodput), does the simulator (engine/planning/sim.py) predict the live hit
rate, and what does the router's own decision cost?

Setup (engine/serving/stack.py): etcd, one store node per prefill worker, ``--prefill``
prefill workers (tiny model) each beside its node, ``--decode`` decode workers, and one
router per policy over the same workers (binds 127.0.0.1; all stopped by PID).

The slice: the conversations whose first request is among the trace's first
``--sessions`` requests, with all their turns (a contiguous window holds almost no
follow-ups: turns are ~2 minutes apart). Each trace block (hash_id) becomes
``--block-tokens`` token ids drawn from a seeded RNG keyed by (run salt, hash_id), so
requests sharing hash_ids share tokens and runs never share blocks; prompts are cut
at ``--max-prompt`` tokens. Arrivals keep the trace's order with Poisson gaps at
``--rate`` requests/s (the trace's own gaps span an hour for this slice).

Runs alternate policies (the order rotates each round) ``--rounds`` times; the
report gives per-policy medians over rounds. The simulator replays the same slice
(same arrivals, blocks, prompt lengths, prefill workers, decode workers, calibrated
cost model) with each policy; its hit rate is set beside the live one.

    python benchmarks/bench_router.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.planning.trace import TraceRequest, load_trace  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
VOCAB_LO, VOCAB_HI = 8, 500  # the tiny model's vocabulary, clear of its special tokens


def _conv_key(r: TraceRequest) -> Any:
    return r.hash_ids[1] if len(r.hash_ids) > 1 else ("solo", r.index)


def make_slice(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The slice's requests: hash_ids (cut to the prompt cap), prompt length, output
    length, arrival (s). Deterministic in ``args.seed``."""
    rs = load_trace(Path(args.trace))
    keys = {_conv_key(r) for r in rs[: args.sessions]}
    chosen = [r for r in rs if _conv_key(r) in keys]
    rng = random.Random(args.seed)
    t, out = 0.0, []
    bt = args.block_tokens
    for r in chosen:
        n = min(math.ceil(r.input_length * bt / 512), args.max_prompt)
        blocks = min(len(r.hash_ids), math.ceil(n / bt))
        n = min(n, blocks * bt)
        out.append(
            {
                "hash_ids": list(r.hash_ids[:blocks]),
                "prompt_tokens": n,
                "max_tokens": max(1, min(args.max_tokens, round(r.output_length / 64))),
                "arrival_s": t,
            }
        )
        t += rng.expovariate(args.rate)
    return out


def prompt_ids(req: dict[str, Any], salt: str, bt: int) -> list[int]:
    ids: list[int] = []
    for h in req["hash_ids"]:
        rng = random.Random(f"{salt}/{h}")
        ids += [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(bt)]
    return ids[: req["prompt_tokens"]]


async def one(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> dict:
    body = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, chunks, usage, err = None, 0, None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                err = f"http {resp.status_code}: {(await resp.aread()).decode()[:120]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        err = obj["error"].get("code", "error")
                        continue
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    if obj.get("usage"):
                        usage = obj["usage"]
                    elif obj.get("choices"):
                        chunks += 1
    except httpx.HTTPError as exc:
        err = type(exc).__name__
    total = time.perf_counter() - t0
    kv = (usage or {}).get("kvstore") or {}
    n_out = int((usage or {}).get("completion_tokens", 0))
    return {
        "ok": err is None and usage is not None,
        "error": err,
        "ttft_s": ttft if ttft is not None else total,
        "tpot_s": (total - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else 0.0,
        "prompt_tokens": int((usage or {}).get("prompt_tokens", len(ids))),
        "cached_tokens": int(kv.get("cached_tokens", 0)),
        "prefill_worker": kv.get("prefill_worker"),
    }


async def replay_live(url: str, reqs: list[dict], salt: str, bt: int, limit_s: float) -> dict:
    """Send the slice at its arrival times; returns per-request records and wall time."""
    prompts = [prompt_ids(r, salt, bt) for r in reqs]
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=limit_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(i: int) -> dict:
            delay = reqs[i]["arrival_s"] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await one(client, url, prompts[i], reqs[i]["max_tokens"])

        out = await asyncio.wait_for(
            asyncio.gather(*(at(i) for i in range(len(reqs)))), timeout=limit_s
        )
        wall = time.perf_counter() - t0
    return {"records": list(out), "wall_s": wall}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(run: dict, slo_ttft: float, slo_tpot: float) -> dict:
    recs = run["records"]
    ok = [r for r in recs if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    good = [r for r in ok if r["ttft_s"] <= slo_ttft and r["tpot_s"] <= slo_tpot]
    spread: dict[str, int] = {}
    for r in ok:
        spread[str(r["prefill_worker"])] = spread.get(str(r["prefill_worker"]), 0) + 1
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
        "tpot_p50_ms": pct([r["tpot_s"] for r in ok if r["tpot_s"] > 0], 0.5) * 1e3,
        "hit_rate": sum(r["cached_tokens"] for r in ok)
        / max(sum(r["prompt_tokens"] for r in ok), 1),
        "slo_attainment": len(good) / max(len(recs), 1),
        "goodput_rps": len(good) / run["wall_s"],
        "wall_s": run["wall_s"],
        "prefill_spread": spread,
        "error_kinds": sorted({str(r["error"]) for r in recs if not r["ok"]}),
    }


def simulate(reqs: list[dict], policy: str, args: argparse.Namespace, coeffs: Any) -> dict:
    """engine/planning/sim.py on the same slice: same arrivals, blocks, lengths and cluster."""
    from engine.planning.scheduler import DEFAULT_PREFILL, CostModel, PrefillModel
    from engine.planning.sim import SimConfig, replay

    trace = [
        TraceRequest(
            i,
            i + 1,
            r["arrival_s"] * 1e3,
            r["prompt_tokens"],
            r["max_tokens"],
            tuple(r["hash_ids"]),
        )
        for i, r in enumerate(reqs)
    ]
    prefill = PrefillModel(tuple(coeffs), "workers' calibration") if coeffs else DEFAULT_PREFILL
    kv_per_token = 2 * 2 * 2 * 16 * 4  # tiny: layers 2, K and V, 2 KV heads, head dim 16, fp32
    cost = CostModel(prefill, kv_per_token, block_tokens=args.block_tokens)
    cfg = SimConfig(
        nodes=args.prefill, dram_blocks=None, ssd_blocks=0, scheduler=policy,
        block_tokens=args.block_tokens, decode_nodes=args.decode, tpot_s=0.005,
    )  # fmt: skip
    res = replay(trace, cfg, cost)
    return {"hit_rate": res.hit_rate, "ttft_p50_ms": res.ttft_p50_s * 1e3,
            "ttft_p99_ms": res.ttft_p99_s * 1e3}  # fmt: skip


def router_cost(stack: Any, n_tokens: int, iters: int) -> dict:
    """The router's own per-request work for an ``n_tokens`` chat prompt, in process:
    tokenize (chat template), prefix keys, directory mirror, decision. The prompt is
    first served once through the router, so the mirror holds its blocks."""
    from types import SimpleNamespace

    from engine.registry import WorkerView
    from engine.serving.loading import load_tokenizer
    from engine.serving.placement import Placer, PrefixView
    from engine.serving.prompts import PromptEncoder
    from engine.serving.router import encode_request
    from kvstore import Namespace, StoreClient, prefix_keys

    tok = load_tokenizer("tiny")
    words = ["the", "cache", "keeps", "keys", "and", "values", "of", "recent", "prompts"]
    rng = random.Random(1)
    text = ""
    while len(tok(text).input_ids) < n_tokens:
        text += " ".join(rng.choice(words) for _ in range(200)) + " "
    ids0 = tok(text).input_ids[:n_tokens]
    text = tok.decode(ids0)
    req = SimpleNamespace(kind="chat", messages=[{"role": "user", "content": text}], prompt=None)
    # The tiny model's context is 2048 tokens: the router refuses the whole prompt, so
    # its first 1900 tokens are served (as token ids) to put a cached prefix in the mirror.
    head = encode_request(PromptEncoder(tok), req).ids[:1900]
    body = {"model": "tiny", "prompt": head, "max_tokens": 2}
    url = stack.url(stack.policies[0])
    httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()

    async def records() -> list[Any]:
        view = WorkerView(stack.cluster.etcd_endpoint, stack.cluster_name)
        await view.start()
        await asyncio.sleep(1.0)
        ws = [w for w in view.workers().values() if w.model == "tiny"]
        await view.stop()
        return ws

    workers = asyncio.run(records())
    client = StoreClient.from_etcd(stack.cluster.etcd_endpoint, cluster=stack.cluster_name,
                                   token=stack.token)  # fmt: skip
    try:
        time.sleep(1.0)  # the mirror's first sync
        placer = Placer(PrefixView(client), "cache_aware")
        nodes = client.nodes()
        w0 = workers[0]
        ns = Namespace(**w0.namespace)
        parts: dict[str, list[float]] = collections.defaultdict(list)
        cached = 0
        enc = PromptEncoder(tok)
        # Three prompts of ~n_tokens. novel: a new 4k-token message nothing holds (the
        # router tokenizes up to the first block no node holds: one chunk). cached_head:
        # the message whose first 1,900 tokens the cluster holds, its text never seen by
        # this encoder (a restarted router, or another router's conversation): tokenized
        # up to the end of the held head. follow_up: the same history plus a new short
        # question, history pieces cached. Every iteration's question or text is new.
        n_words = len(text.split())
        novel = [
            " ".join(rng.choice(words) for _ in range(n_words)) + f" (novel {i})"
            for i in range(iters)
        ]
        for kind in ("novel", "cached_head", "follow_up"):
            if kind == "follow_up":  # the earlier turn was served: its pieces are filed
                enc.encode_chat([{"role": "user", "content": text}])
            for i in range(iters):
                if kind == "novel":
                    msgs = [{"role": "user", "content": novel[i]}]
                elif kind == "cached_head":
                    msgs = [{"role": "user", "content": f"{text} (question {i})"}]
                else:
                    msgs = [{"role": "user", "content": text},
                            {"role": "assistant", "content": "Noted."},
                            {"role": "user", "content": f"And question {i}?"}]  # fmt: skip
                r = SimpleNamespace(kind="chat", messages=msgs, prompt=None)
                t0 = time.perf_counter()
                got = encode_request(enc, r, placer.held_walk(workers))
                ids = got.ids
                t1 = time.perf_counter()
                keys = prefix_keys(ids, w0.block_tokens, ns)
                t2 = time.perf_counter()
                placer.prefixes.runs(keys)
                t3 = time.perf_counter()
                route = placer.place(workers, ids, 16, frozenset(), nodes, n_tokens=got.n_tokens)
                t4 = time.perf_counter()
                parts[f"{kind}.tokenize"].append(t1 - t0)
                parts[f"{kind}.keys"].append(t2 - t1)
                parts[f"{kind}.mirror"].append(t3 - t2)
                # place() = keys + mirror + decision (it recomputes the first two): the
                # router's work per request is tokenize + place
                parts[f"{kind}.place"].append(t4 - t3)
                parts[f"{kind}.total"].append((t1 - t0) + (t4 - t3))
                cached = getattr(route, "expected_cached", 0)
    finally:
        client.close()
    p50 = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    for kind in ("novel", "cached_head", "follow_up"):
        place = p50[f"{kind}.place"] - p50[f"{kind}.keys"] - p50[f"{kind}.mirror"]
        p50[f"{kind}.decision"] = max(place, 0.0)
    return {"prompt_tokens": len(ids), "expected_cached": cached,
            "p50_ms": {k: round(v, 3) for k, v in p50.items()}}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="cache_aware,round_robin,least_loaded,longest_prefix")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trace", default=str(TRACE), help="conversation trace (JSONL)")
    p.add_argument("--sessions", type=int, default=40, help="conversations: first N requests'")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per trace block")
    p.add_argument("--max-prompt", type=int, default=1900)
    p.add_argument("--max-tokens", type=int, default=8, help="cap on output tokens")
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second")
    p.add_argument("--prefill", type=int, default=3)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--slo-ttft-ms", type=float, default=250.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--run-limit-s", type=float, default=120.0, help="bound on one replay")
    p.add_argument("--cost-tokens", type=int, default=4096)
    p.add_argument("--cost-iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the full report here")
    args = p.parse_args()

    from engine.serving.stack import ServingStack, WorkerSpec

    policies = tuple(args.policies.split(","))
    reqs = make_slice(args)
    specs = [WorkerSpec(f"p{i}", "prefill", f"n{i}") for i in range(args.prefill)]
    specs += [WorkerSpec(f"d{i}", "decode", f"n{i % args.prefill}") for i in range(args.decode)]
    t_start = time.perf_counter()
    stack = ServingStack(
        model="tiny", nodes=args.prefill, workers=specs, policies=policies, dram="512MiB",
        cluster="bench", router_flags=("--short-prompt-tokens", "0"),
    )  # fmt: skip
    runs: dict[str, list[dict]] = {pol: [] for pol in policies}
    with stack:
        print(f"stack up in {time.perf_counter() - t_start:.1f} s: {stack.pids()}", flush=True)
        for pol in policies:  # first calls load the tokenizer and open connections
            warm = {"model": "tiny", "prompt": list(range(8, 40)), "max_tokens": 2}
            httpx.post(stack.url(pol) + "/v1/completions", json=warm, timeout=120)
        for rnd in range(args.rounds):
            order = policies[rnd % len(policies) :] + policies[: rnd % len(policies)]
            for pol in order:
                run = asyncio.run(
                    replay_live(stack.url(pol), reqs, f"{rnd}/{pol}", args.block_tokens,
                                args.run_limit_s)
                )  # fmt: skip
                s = summarize(run, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                runs[pol].append(s)
                print(f"round {rnd} {pol:15s} " + json.dumps(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}
                ), flush=True)  # fmt: skip
                time.sleep(1.0)
        coeffs = _coeffs(stack)
        cost = router_cost(stack, args.cost_tokens, args.cost_iters)
    sims = {pol: simulate(reqs, pol, args, coeffs) for pol in policies}
    med = statistics.median
    table = {}
    for pol in policies:
        rs = runs[pol]
        table[pol] = {
            k: med(r[k] for r in rs)
            for k in (
                "ttft_p50_ms",
                "ttft_p99_ms",
                "tpot_p50_ms",
                "hit_rate",
                "slo_attainment",
                "goodput_rps",
                "errors",
            )
        }
        table[pol]["sim_hit_rate"] = sims[pol]["hit_rate"]
    report = {
        "args": vars(args),
        "slice": {
            "requests": len(reqs),
            "prompt_tokens_p50": med(r["prompt_tokens"] for r in reqs),
            "span_s": reqs[-1]["arrival_s"],
        },
        "policies": table,
        "runs": runs,
        "sim": sims,
        "router_cost": cost,
        "prefill_coeffs": coeffs,
    }
    print(json.dumps({"policies": table, "router_cost": cost, "slice": report["slice"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _coeffs(stack: Any) -> Any:
    """The median of the prefill workers' calibrations, as the router uses them."""

    async def get() -> Any:
        from engine.registry import WorkerView

        view = WorkerView(stack.cluster.etcd_endpoint, stack.cluster_name)
        await view.start()
        await asyncio.sleep(0.5)
        cs = [w.prefill_coeffs for w in view.workers().values() if w.prefill_coeffs]
        await view.stop()
        return [statistics.median(c[i] for c in cs) for i in range(3)] if cs else None

    return asyncio.run(get())


if __name__ == "__main__":
    sys.exit(main())
