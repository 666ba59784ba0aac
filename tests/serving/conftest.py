"""Shared pieces of the serving tests: prompts, the plain-engine reference."""

from __future__ import annotations

import random
from typing import Any

import torch

from engine.hf.models import tiny_llama
from engine.serving.loading import load_tokenizer

WORDS = [
    "cluster",
    "prefill",
    "decode",
    "cache",
    "memory",
    "flash",
    "keys",
    "values",
    "prompt",
    "token",
    "node",
    "host",
    "machine",
    "answer",
    "history",
    "conversation",
    "operator",
    "model",
    "shared",
    "tier",
    "block",
    "store",
]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    tok = load_tokenizer("tiny")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tok(text, add_special_tokens=False).input_ids]


def plain_engine(ids: list[int], n: int, dtype: torch.dtype = torch.float32) -> str:
    """What a plain transformers engine answers: one greedy generate() on the same
    weights (the tiny model, seed 0), decoded with the same tokenizer."""
    return plain_greedy(ids, n, dtype)[0]


def plain_greedy(ids: list[int], n: int, dtype: torch.dtype = torch.float32) -> tuple[str, float]:
    """:func:`plain_engine`'s answer and the smallest gap between the two best logits
    over its greedy choices. An engine that computes some of the answer's KV another
    way (a moved stream recomputes its tail in one pass) rounds differently; with every
    gap far above that rounding, any correct engine picks the same tokens."""
    tok = load_tokenizer("tiny")
    out = _generate(ids, n, dtype)
    best = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values
    gap = float((best[:, 0] - best[:, 1]).min())
    return str(tok.decode(out.sequences[0, len(ids) :].tolist(), skip_special_tokens=True)), gap


def plain_ids(ids: list[int], n: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """:func:`plain_engine`'s answer as token ids."""
    return [int(t) for t in _generate(ids, n, dtype).sequences[0, len(ids) :].tolist()]


def _generate(ids: list[int], n: int, dtype: torch.dtype) -> Any:
    tok = load_tokenizer("tiny")
    model: Any = tiny_llama(dtype)
    with torch.inference_mode():
        return model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
