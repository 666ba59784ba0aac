"""The main job: chat traffic through disaggregated prefill and decode workers.

Conversations share a system prompt; each turn's prompt is the conversation so far
(including the answers the decode worker generated) plus a new user message. The
prefill worker reuses whatever prefix the store holds, computes the rest and writes
new blocks; the decode worker rebuilds the cache from the store and generates. Each
request's TTFT is also measured computed from scratch (a plain forward pass of the
whole prompt), so the table shows what the store bought per request class.

Runs on embedded defaults: one in-process StoreNode with a DRAM tier small enough
that older turns demote to the SSD tier and come back promoted on a hit.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.blockstore import NodeStore
from engine.hf.adapter import HFKVAdapter
from engine.hf.models import load_smollm2, tiny_llama
from engine.hf.workers import DecodeWorker, PrefillWorker
from kvstore.config import NodeConfig, parse_size
from kvstore.node.store import StoreNode

__all__ = ["DemoResult", "run_demo"]


@dataclass
class _Req:
    cls: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    scratch_s: float
    fetch_s: float


def class_summary(requests: Sequence[Any], *, fetch: bool = False) -> dict[str, Any]:
    """Per request class (``cls``): count, prompt tokens p50, the share of prompt tokens
    served from the store, and TTFT p50 with the store and from scratch (and the fetch
    time p50 where requests record it). The demo's table, in process or live."""
    out: dict[str, Any] = {}
    med = statistics.median
    for cls in sorted({r.cls for r in requests}):
        rs = [r for r in requests if r.cls == cls]
        out[cls] = {
            "requests": len(rs),
            "prompt_tokens_p50": med(r.prompt_tokens for r in rs),
            "cached_share": sum(r.cached_tokens for r in rs)
            / max(sum(r.prompt_tokens for r in rs), 1),
            "ttft_store_p50_s": med(r.ttft_s for r in rs),
            "ttft_scratch_p50_s": med(r.scratch_s for r in rs),
        }
        if fetch:
            out[cls]["fetch_p50_s"] = med(r.fetch_s for r in rs)
    return out


@dataclass
class DemoResult:
    """Per-request records plus the node's final stats."""

    model: str
    block_bytes: int
    requests: list[_Req] = field(default_factory=list)
    node: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    sample: str = ""

    def summary(self) -> dict[str, Any]:
        """Per request class: TTFT with the store vs from scratch, and cache share."""
        return class_summary(self.requests, fetch=True)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        c = self.node.get("counters", {})
        hits = {t: c.get(f"hits_{t}", 0) for t in ("hbm", "dram", "ssd")}
        lookups = sum(hits.values()) + c.get("misses", 0)
        return {
            "model": self.model,
            "block_bytes": self.block_bytes,
            "seconds": self.seconds,
            "classes": self.summary(),
            "hit_rate_per_tier": {t: n / max(lookups, 1) for t, n in hits.items() if n},
            "bytes_moved": {
                "engine->dram (put)": c.get("bytes_in", 0),
                "store->engine (get_into)": c.get("bytes_out", 0),
                "dram->ssd (demotion)": c.get("bytes_demoted_dram", 0),
                "ssd->dram (promotion)": c.get("bytes_promoted", 0),
            },
            "node": self.node,
            "sample_answer": self.sample,
        }


SYSTEM = (
    "You are a helpful assistant for the operators of a GPU inference cluster. The cluster "
    "serves chat models with separate prefill and decode machines. Prefill machines turn a "
    "prompt into attention keys and values; decode machines generate the answer one token at "
    "a time. A shared cache keeps the keys and values of recent prompts in GPU memory, host "
    "memory and local flash, so a conversation that comes back does not pay for its history "
    "again. Answer briefly and concretely, in plain words, and say when you are not sure. "
)
QUESTIONS = [
    "What is a good first step when a node runs out of memory?",
    "Why would a long conversation start faster the second time?",
    "How should I pick the size of the host memory cache?",
    "What does it mean when the hit rate drops suddenly?",
    "Name one risk of sharing a cache between two teams.",
    "How do I know whether flash storage is too slow for the cache?",
    "What should happen when a cache machine dies?",
    "Give me one metric to watch every morning.",
]


class _Talk:
    """Turns of one conversation as token ids (real text when a tokenizer exists)."""

    def __init__(self, tok: Any, vocab: int, rng: random.Random) -> None:
        self.tok, self.vocab, self.rng = tok, vocab, rng
        self.ids: list[int] = self._encode(SYSTEM) if tok else self._noise(256)

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok(text, add_special_tokens=False).input_ids]

    def _noise(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def ask(self) -> list[int]:
        """Append a user message; returns the prompt."""
        if self.tok is None:
            self.ids += self._noise(self.rng.randint(48, 128))
        else:
            q = self.rng.choice(QUESTIONS)
            self.ids += self._encode(f"\nUser: {q}\nAssistant:")
        return list(self.ids)


def _load(model: str) -> tuple[Any, Any, str]:
    if model == "tiny":
        return tiny_llama(torch.float32, layers=4), None, "tiny-llama-random"
    m, tok = load_smollm2(torch.float32)
    return m, tok, "smollm2-135m"


def run_demo(
    *,
    model: str = "smollm2",
    conversations: int = 3,
    turns: int = 3,
    new_tokens: int = 24,
    dram: str = "8MiB",
    ssd: str = "1GiB",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> DemoResult:
    """Serve ``conversations x turns`` chat requests; returns per-request records."""
    m, tok, name = _load(model)
    rng = random.Random(seed)
    convs = [_Talk(tok, m.config.vocab_size, rng) for _ in range(conversations)]
    total = conversations * turns
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        cfg = NodeConfig.load(
            node_id="demo",
            dram_bytes=parse_size(dram, "dram"),
            ssd_path=f"{tmp}/ssd",
            ssd_bytes=parse_size(ssd, "ssd"),
            policy="s3fifo",
        )
        with StoreNode(cfg) as node:
            ad = HFKVAdapter(m, model_id=name, block_tokens=16)
            result = DemoResult(name, ad.layout.block_bytes())
            store = NodeStore(node, ad.namespace)
            prefill, decode = PrefillWorker(ad, store), DecodeWorker(ad, store)
            done = 0
            for turn in range(turns):
                for c, talk in enumerate(convs):
                    conv = talk.ask()
                    h = prefill.prefill(f"c{c}t{turn}", conv)
                    answer = list(decode.decode(h, new_tokens))
                    with torch.inference_mode():
                        s0 = time.perf_counter()
                        m(torch.tensor([conv]))
                        scratch = time.perf_counter() - s0
                    cls = "first turn" if turn == 0 else "follow-up"
                    result.requests.append(
                        _Req(
                            cls,
                            len(conv),
                            h.stats.cached_blocks * 16,
                            h.stats.ttft_s,
                            scratch,
                            h.stats.fetch_s,
                        )
                    )
                    if tok is not None and not result.sample:
                        result.sample = tok.decode(answer, skip_special_tokens=True).strip()
                    talk.ids += answer
                    done += 1
                    if progress is not None:
                        progress(done, total)
            result.node = node.stats()
    result.seconds = time.perf_counter() - t0
    return result
