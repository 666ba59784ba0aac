"""``vllm serve`` pools behind ``kvstore vllm-router`` against a plain ``vllm serve``.

The stack of tests/support/vllm_serve.py: a ``kvstore serve`` on loopback, a prefill
server (kvstore's connector, kv_producer), a decode server (kv_consumer), a plain
server with no connector, and the router in front of the first two, all on this host.
The model is a random-weight bf16 Llama written to disk (``--geometry wide``: 16
layers, 8 KV heads of 128, 2 MiB of KV per 32-token block). Per run, in the same run
and on the same prompts (fresh ones per run, so no server has seen them):

- TTFT of a new prompt (streamed, to the first token): plain, and through the router
  (prefill with max_tokens=1, the blocks saved, then the decode server loads them and
  answers);
- TTFT of the same prompt asked again: plain (its own prefix cache), and through the
  router (the store holds every block: no prefill, the decode server answers);
- throughput: ``--requests`` new prompts sent ``--concurrency`` at a time, output
  tokens per second, plain and through the router.

Both sides share this host's CPUs; disaggregation pays where prefill and decode run on
different machines, which this cannot show. What it shows is the cost of the path.
Runs in .venv-vllm:

    .venv-vllm/bin/python benchmarks/bench_vllm_serve.py [--runs 3] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prompt(rnd: random.Random, tokens: int) -> list[int]:
    return [rnd.randrange(4, 8000) for _ in range(tokens)]


def ttft(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed token, and the whole text."""
    t0 = time.perf_counter()
    first = None
    text = []
    for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
    ):
        if ch.choices and ch.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if ch.choices:
            text.append(ch.choices[0].text)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def throughput(
    client: Any, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> float:
    """Output tokens per second for ``prompts`` sent ``concurrency`` at a time."""

    def one(p: list[int]) -> int:
        r = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0.0)
        return int(r.usage.completion_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--geometry", choices=("wide", "tiny"), default="wide")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import openai

    from tests.support.vllm_fixtures import TINY, WIDE, write_tiny_llama
    from tests.support.vllm_serve import serve_stack

    g = {"wide": WIDE, "tiny": TINY}[args.geometry]
    res: dict[str, list[float]] = {}
    same = True
    with tempfile.TemporaryDirectory(prefix="bench-vllm-serve-") as tmp:
        root = Path(tmp)
        model = write_tiny_llama(root / "model", save_dtype="bfloat16", **g)
        with serve_stack(root, model, "bfloat16") as s:
            via = openai.OpenAI(base_url=s["router"] + "/v1", api_key="unused", timeout=600)
            plain = openai.OpenAI(base_url=s["plain"].url + "/v1", api_key="unused", timeout=600)
            name = s["model"]
            rnd = random.Random(20261125)
            warm = _prompt(rnd, 64)  # first requests pay for lazy set-up: not timed
            ttft(via, name, warm, 2)
            ttft(plain, name, warm, 2)
            for _ in range(args.runs):
                p = _prompt(rnd, args.tokens)
                texts = set()
                for label, client in (("plain", plain), ("router", via)):
                    t, text = ttft(client, name, p, args.max_tokens)
                    res.setdefault(f"{label}_new", []).append(t)
                    t2, text2 = ttft(client, name, p, args.max_tokens)
                    res.setdefault(f"{label}_again", []).append(t2)
                    texts |= {text, text2}
                same &= len(texts) == 1
                batch = [_prompt(rnd, args.tokens) for _ in range(args.requests)]
                for label, client in (("plain", plain), ("router", via)):
                    tps = throughput(client, name, batch, args.max_tokens, args.concurrency)
                    res.setdefault(f"{label}_tps", []).append(tps)
                    batch = [_prompt(rnd, args.tokens) for _ in range(args.requests)]
    med = {k: statistics.median(v) for k, v in res.items()}
    report = {"args": vars(args), "medians": med, "same_tokens": same}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"vllm serve pools behind kvstore vllm-router vs a plain vllm serve: {args.geometry}, "
        f"{args.tokens}-token prompts, medians of {args.runs} runs (same host, 2 CPUs)\n"
    )
    rows = [
        ("TTFT, new prompt (s)", "plain_new", "router_new"),
        ("TTFT, same prompt again (s)", "plain_again", "router_again"),
        (
            f"output tokens/s, {args.requests} prompts x{args.concurrency}",
            "plain_tps",
            "router_tps",
        ),
    ]
    print(f"{'':<40} {'plain':>9} {'router':>9} {'router/plain':>13}")
    for label, a, b in rows:
        print(f"{label:<40} {med[a]:9.3f} {med[b]:9.3f} {med[b] / med[a]:13.2f}")
    print(f"\nanswers identical through the router: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
