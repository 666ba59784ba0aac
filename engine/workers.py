"""Disaggregated prefill and decode workers that share KV only through the store.

The prefill worker matches the prompt's longest stored prefix, loads it, computes
the rest, writes the new full blocks and hands the request off (prompt + first
token). The decode worker, typically another process on another host, fetches the
prompt's blocks from the store, recomputes only the tail that is not a full block
(at least the last prompt token), checks that it reproduces the prefill's first
token, and streams greedy tokens. Neither worker sees the other's tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.hf import BlockStore, HFKVAdapter

__all__ = ["DecodeWorker", "Handoff", "PrefillStats", "PrefillWorker"]


@dataclass(slots=True)
class PrefillStats:
    """Where a prefill's time went (wall and CPU seconds)."""

    prompt_tokens: int = 0
    cached_blocks: int = 0
    computed_tokens: int = 0
    stored_blocks: int = 0
    fetch_s: float = 0.0
    compute_s: float = 0.0
    store_s: float = 0.0
    ttft_s: float = 0.0
    cpu_s: float = 0.0


@dataclass(slots=True)
class Handoff:
    """What a prefill worker passes to a decode worker: ids, not tensors."""

    request_id: str
    prompt: list[int]
    first_token: int
    stats: PrefillStats = field(default_factory=PrefillStats)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for a queue or a pipe between processes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Handoff:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["request_id"],
            list(d["prompt"]),
            int(d["first_token"]),
            PrefillStats(**d.get("stats", {})),
        )


def _as_ids(prompt: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


class PrefillWorker:
    """Computes prompts, reusing and extending the store's prefix cache."""

    def __init__(self, adapter: HFKVAdapter, store: BlockStore) -> None:
        self.adapter = adapter
        self.store = store

    @torch.inference_mode()
    def prefill(self, request_id: str, prompt: Sequence[int] | torch.Tensor) -> Handoff:
        """Run one prompt; returns the handoff carrying the first generated token."""
        ids = _as_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        st = PrefillStats(prompt_tokens=len(ids))
        t0, c0 = time.perf_counter(), time.process_time()
        keys = self.adapter.keys(ids)
        n, cache = self.adapter.load_prefix(self.store, keys, len(ids))
        t1 = time.perf_counter()
        start = n * self.adapter.block_tokens
        out = self.adapter.model(torch.tensor([ids[start:]]), past_key_values=cache, use_cache=True)
        first = int(out.logits[0, -1].argmax())
        t2 = time.perf_counter()
        st.ttft_s, st.cpu_s = t2 - t0, time.process_time() - c0
        st.stored_blocks = self.adapter.store_blocks(self.store, keys, out.past_key_values, n)
        st.cached_blocks, st.computed_tokens = n, len(ids) - start
        st.fetch_s, st.compute_s, st.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return Handoff(request_id, ids, first, st)


class DecodeWorker:
    """Continues a handed-off request from KV fetched out of the store."""

    def __init__(self, adapter: HFKVAdapter, store: BlockStore) -> None:
        self.adapter = adapter
        self.store = store
        self.last_loaded_blocks = 0
        self.first_token_mismatches = 0

    @torch.inference_mode()
    def decode(
        self, handoff: Handoff, max_new_tokens: int, eos_token_id: int | None = None
    ) -> Iterator[int]:
        """Yield greedy tokens, the handoff's first token first."""
        ids = handoff.prompt
        keys = self.adapter.keys(ids)
        n, cache = self.adapter.load_prefix(self.store, keys, len(ids))
        self.last_loaded_blocks = n
        start = n * self.adapter.block_tokens
        out = self.adapter.model(torch.tensor([ids[start:]]), past_key_values=cache, use_cache=True)
        if int(out.logits[0, -1].argmax()) != handoff.first_token:
            # Same weights and same KV give the same token; a difference means the
            # loaded KV is not what prefill computed. Counted, and prefill's token wins.
            self.first_token_mismatches += 1
        tok = handoff.first_token
        cache = out.past_key_values
        for i in range(max_new_tokens):
            yield tok
            if tok == eos_token_id or i == max_new_tokens - 1:
                return
            out = self.adapter.model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
