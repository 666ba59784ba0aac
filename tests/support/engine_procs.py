"""Worker processes for the disaggregated engine test: each one builds its own model
(same seed, so the same weights) and reaches the store only through StoreClient."""

from __future__ import annotations

from typing import Any

import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import DecodeWorker, Handoff, PrefillWorker
from kvstore.client import StoreClient
from tests.support.models import tiny_llama

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _adapter(dtype: str) -> HFKVAdapter:
    return HFKVAdapter(tiny_llama(_DTYPES[dtype]), model_id="tiny", block_tokens=16)


def prefill(address: str, token: str, dtype: str, prompts: list[list[int]]) -> list[dict]:
    """Prefill each prompt in order; returns the handoffs (plain dicts)."""
    ad = _adapter(dtype)
    with StoreClient.connect(address, token=token, namespace=ad.namespace) as client:
        worker = PrefillWorker(ad, client)
        out = [worker.prefill(f"r{i}", p).to_dict() for i, p in enumerate(prompts)]
        for h in out:
            h["transport"] = client.transport
        return out


def decode(address: str, token: str, dtype: str, handoffs: list[dict], n: int) -> list[Any]:
    """Decode each handoff; returns (tokens, blocks loaded, first-token mismatches)."""
    ad = _adapter(dtype)
    with StoreClient.connect(address, token=token, namespace=ad.namespace) as client:
        worker = DecodeWorker(ad, client)
        res = []
        for d in handoffs:
            toks = list(worker.decode(Handoff.from_dict(d), n))
            res.append((toks, worker.last_loaded_blocks, worker.first_token_mismatches))
        return res
