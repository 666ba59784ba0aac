"""Reference outputs for engine tests; the models themselves live in engine/hf/models.py."""

from __future__ import annotations

from typing import Any

import torch

from engine.hf.models import tiny_llama

__all__ = ["reference_tokens", "tiny_llama"]


def reference_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from ordinary generate() on the same weights."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return [int(t) for t in out[0, len(prompt) :]]
