"""Small real transformers for tests: a random-weight Llama, fixed seed."""

from __future__ import annotations

import torch


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):  # type: ignore[no-untyped-def]
    """A 2-layer Llama with GQA (4 heads, 2 KV heads, head dim 16) and varied output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def reference_tokens(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy tokens from ordinary generate() on the same weights."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return [int(t) for t in out[0, len(prompt) :]]
