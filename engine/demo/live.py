"""The main job, live: chat traffic through the router of a real serving stack.

Starts, as child processes of this one (engine/serving/stack.py): etcd, store nodes,
prefill workers (each beside its own node), decode workers and the OpenAI-compatible
router. Then the same conversations as the in-process demo (engine/demo/inproc.py) go
through the router's ``/v1/chat/completions``, streamed, with the ``openai`` client:
each turn's messages are the conversation so far (the answers the decode worker
streamed back included) plus a new user question. Every answer says where it went
(``usage.kvstore`` and the ``x-kvstore-*`` headers): prefill worker, decode worker,
cached prompt tokens and the tier they came from.

TTFT is measured by the client: request sent to first streamed chunk. After the stack
is stopped (by PID), each prompt is computed from scratch once in this process, on
the same weights and tokenizer, for the "from scratch" column.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.demo.inproc import QUESTIONS, SYSTEM, class_summary

__all__ = ["LiveRequest", "LiveResult", "run_live_demo"]


@dataclass
class LiveRequest:
    """One chat request as the client saw it, and where the router sent it."""

    conversation: int
    turn: int
    cls: str
    prompt_tokens: int
    cached_tokens: int
    tier: str | None
    prefill_worker: str
    decode_worker: str
    short_prompt: bool
    ttft_s: float
    total_s: float
    completion_tokens: int
    scratch_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class LiveResult:
    """Per-request records, the store nodes' stats and the processes that ran."""

    model: str
    policy: str
    block_bytes: int = 0
    requests: list[LiveRequest] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)
    stopped: bool = False
    startup_s: float = 0.0
    seconds: float = 0.0
    router: str = ""
    sample: str = ""

    def summary(self) -> dict[str, Any]:
        """Per request class: TTFT through the router vs from scratch, cache share."""
        return class_summary(self.requests)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json`` (the in-process demo's keys, plus routes)."""
        tiers: dict[str, dict[str, int]] = {}
        counters: dict[str, int] = {}
        server: dict[str, int] = {}
        for st in self.nodes.values():
            for name, t in st.get("tiers", {}).items():
                agg = tiers.setdefault(name, {"capacity": 0, "used": 0, "blocks": 0})
                for k in agg:
                    agg[k] += int(t.get(k, 0))
            for k, v in st.get("counters", {}).items():
                counters[k] = counters.get(k, 0) + int(v)
            for k, v in st.get("server", {}).items():
                if isinstance(v, int):
                    server[k] = server.get(k, 0) + v
        hits = {t: counters.get(f"hits_{t}", 0) for t in ("hbm", "dram", "ssd")}
        lookups = sum(hits.values()) + counters.get("misses", 0)
        reads = sum(v for k, v in server.items() if k.startswith("bytes_out"))
        return {
            "mode": "live",
            "model": self.model,
            "policy": self.policy,
            "block_bytes": self.block_bytes,
            "seconds": self.seconds,
            "startup_s": self.startup_s,
            "classes": self.summary(),
            "routes": [
                {k: v for k, v in asdict(r).items() if k != "headers"} | {"headers": r.headers}
                for r in self.requests
            ],
            "hit_rate_per_tier": {t: n / max(lookups, 1) for t, n in hits.items() if n},
            "bytes_moved": {
                "prefill->store (put)": counters.get("bytes_in", 0),
                "store->workers (get)": reads + counters.get("bytes_out", 0),
                "dram->ssd (demotion)": counters.get("bytes_demoted_dram", 0),
                "ssd->dram (promotion)": counters.get("bytes_promoted", 0),
            },
            "node": {"tiers": tiers, "counters": counters},
            "nodes": self.nodes,
            "workers": {w: s.get("counters", {}) for w, s in self.workers.items()},
            "processes": self.processes,
            "stopped": self.stopped,
            "router": self.router,
            "sample_answer": self.sample,
        }


def _warm(stack: Any, model: str) -> None:
    """First calls pay one-time setup (a first forward, store connections, the
    router's tokenizer): one unrelated request per worker, straight to it, then one
    short chat through the router. None shares a prefix with the demo's prompts."""
    import httpx

    for p in stack.workers.values():
        addr, role = p.facts["address"], p.facts["role"]
        body: dict[str, Any] = {"request_id": "warm-up", "prompt": [7] * 20}
        if role == "prefill":
            httpx.post(addr + "/prefill", json=body, timeout=120).raise_for_status()
        else:
            body.update(max_tokens=2)
            httpx.post(addr + "/generate", json=body, timeout=120).raise_for_status()
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    httpx.post(stack.url() + "/v1/chat/completions", json=chat, timeout=120).raise_for_status()


def _ask(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, text, usage.kvstore and headers."""
    t0 = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    headers = {k: v for k, v in raw.headers.items() if k.startswith("x-kvstore-")}
    ttft: float | None = None
    text, usage = [], None
    for ch in raw.parse():
        if ttft is None:
            ttft = time.perf_counter() - t0
        for c in ch.choices:
            if c.delta.content:
                text.append(c.delta.content)
        if ch.usage is not None:
            usage = ch.usage
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("the router's stream ended without its usage chunk")
    kv = dict((usage.model_extra or {}).get("kvstore") or {})
    return {
        "ttft": ttft if ttft is not None else total,
        "total": total,
        "text": "".join(text),
        "prompt_tokens": int(usage.prompt_tokens),
        "completion_tokens": int(usage.completion_tokens),
        "kv": kv,
        "headers": headers,
    }


def _scratch(model: str, prompts: list[list[int]]) -> tuple[list[float], int]:
    """Each prompt computed from scratch in this process (one forward), and the
    model's block bytes. Runs after the stack is stopped: the CPU is ours."""
    import torch

    from engine.hf.adapter import HFKVAdapter
    from engine.serving.loading import load_model

    torch.set_num_threads(1)  # as each worker runs
    lm = load_model(model, "fp32")
    out = []
    with torch.inference_mode():
        lm.model(torch.tensor([prompts[0][:16]]))  # one-time setup, as the workers warmed
        for ids in prompts:
            t0 = time.perf_counter()
            lm.model(torch.tensor([ids]))
            out.append(time.perf_counter() - t0)
    block = HFKVAdapter(lm.model, model_id=lm.name, block_tokens=16).layout.block_bytes()
    return out, block


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def run_live_demo(
    *,
    model: str = "smollm2",
    conversations: int = 3,
    turns: int = 3,
    new_tokens: int = 24,
    nodes: int = 2,
    prefill: int = 2,
    decode: int = 1,
    policy: str = "cache_aware",
    short_prompt_tokens: int = 32,
    dram: str = "8MiB",
    ssd: str = "1GiB",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    phase: Callable[[str], None] | None = None,
) -> LiveResult:
    """Start the stack, serve ``conversations x turns`` chat requests through the
    router, stop the stack; returns per-request records and where each went."""
    from engine.serving.stack import ServingStack

    say = phase or (lambda _m: None)
    t0 = time.perf_counter()
    # Prefill workers time their model at start (a few seconds), so the router's
    # cost model weighs a cached prefix against recomputing it on this CPU.
    wflags: tuple[str, ...] = ()
    stack = ServingStack(
        model=model, nodes=nodes, prefill=prefill, decode=decode, policies=(policy,),
        dram=dram, ssd=ssd, worker_flags=wflags,
        router_flags=("--short-prompt-tokens", str(short_prompt_tokens)),
    )  # fmt: skip
    result = LiveResult(model, policy)
    talk = _Conversations(result, conversations, random.Random(seed), progress)
    say(f"starting etcd, {nodes} store nodes, {prefill} prefill + {decode} decode workers")
    try:
        stack.start()
        result.processes = stack.pids()
        result.router = stack.url()
        _warm(stack, model)
        result.startup_s = time.perf_counter() - t0
        say(f"router at {result.router}; sending {conversations * turns} chat requests")
        prompts = talk.run(turns, new_tokens)
        result.nodes = stack.node_stats()
        result.workers = stack.worker_stats()
    finally:
        say("stopping every process by PID")
        stack.stop()
    result.stopped = all(_gone(pid) for pid in result.processes.values())
    say("computing each prompt from scratch for comparison")
    scratch, result.block_bytes = _scratch(model, prompts)
    for req, s in zip(result.requests, scratch, strict=True):
        req.scratch_s = s
    result.seconds = time.perf_counter() - t0
    return result


class _Conversations:
    """The demo's chats, turn by turn through the router, each answer recorded in
    ``result`` as a :class:`LiveRequest` (where it ran, what it reused)."""

    def __init__(
        self,
        result: LiveResult,
        conversations: int,
        rng: random.Random,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        from engine.serving.loading import load_tokenizer

        self.result, self.rng, self.progress = result, rng, progress
        self.tok = load_tokenizer(result.model)
        self.talks: list[list[dict[str, str]]] = [
            [{"role": "system", "content": SYSTEM.strip()}] for _ in range(conversations)
        ]

    def run(self, turns: int, new_tokens: int) -> list[list[int]]:
        """Every turn of every conversation, through the router at ``result.router``;
        returns each request's prompt ids."""
        from openai import OpenAI

        client = OpenAI(base_url=self.result.router + "/v1", api_key="none", max_retries=0,
                        timeout=300)  # fmt: skip
        prompts: list[list[int]] = []
        total, done = turns * len(self.talks), 0
        for turn in range(turns):
            for c, msgs in enumerate(self.talks):
                msgs.append({"role": "user", "content": self.rng.choice(QUESTIONS)})
                text = self.tok.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=False
                )
                prompts.append([int(t) for t in self.tok(text, add_special_tokens=False).input_ids])
                r = _ask(client, self.result.model, msgs, new_tokens)
                self._record(c, turn, r)
                msgs.append({"role": "assistant", "content": r["text"]})
                done += 1
                if self.progress is not None:
                    self.progress(done, total)
        return prompts

    def _record(self, c: int, turn: int, r: dict[str, Any]) -> None:
        kv = r["kv"]
        self.result.requests.append(
            LiveRequest(
                conversation=c, turn=turn,
                cls="first turn" if turn == 0 else "follow-up",
                prompt_tokens=r["prompt_tokens"],
                cached_tokens=int(kv.get("cached_tokens", 0)),
                tier=kv.get("tier"),
                prefill_worker=str(kv.get("prefill_worker", "")),
                decode_worker=str(kv.get("decode_worker", "")),
                short_prompt=bool(kv.get("short_prompt", False)),
                ttft_s=r["ttft"], total_s=r["total"],
                completion_tokens=r["completion_tokens"], headers=r["headers"],
            )
        )  # fmt: skip
        if not self.result.sample and self.result.model != "tiny":
            self.result.sample = r["text"].strip()
