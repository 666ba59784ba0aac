"""Token ids of a request's prompt, at the router's cost budget.

The router tokenizes every request (it needs the ids to compute prefix keys), so the
tokenizer is on the request path. Two things keep it cheap:

- the tokenizer's Rust encoder is called directly (``backend_tokenizer.encode``): the
  Python wrapper's BatchEncoding costs more than the encoding itself for a 4k-token
  prompt (5.3 ms against 2.2 ms, measured here with the tiny model's tokenizer);
- a chat's rendered prompt is cut at the tokenizer's special tokens (the chat
  template's message delimiters) and each piece is encoded once and cached. A follow-up
  turn repeats every earlier message, so only its new message and the generation
  prompt are encoded. This is exact only because tokenizers encode the text between
  added tokens independently; :meth:`PromptEncoder.verified` checks it at load on a
  probe conversation (and refuses the cache, keeping whole-text encoding, when a
  tokenizer's added tokens strip or normalize around themselves).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["PromptEncoder"]

_PROBE = [
    {"role": "system", "content": "You answer briefly.\n"},
    {"role": "user", "content": "  Where is the cache?  Tell me — in detail.\n\n"},
    {"role": "assistant", "content": "In DRAM, then on SSD.  "},
    {"role": "user", "content": "And the keys? (hex: 0x1f, tabs:\t)"},
]


class PromptEncoder:
    """Encodes prompts for one tokenizer; thread-safe; a bounded cache of pieces."""

    def __init__(self, tokenizer: Any, *, max_pieces: int = 8192) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._max = max_pieces
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._split: re.Pattern[str] | None = self._splitter()
        self.hits = self.misses = 0
        if self._split is not None and not self.verified():
            self._split = None

    def _splitter(self) -> re.Pattern[str] | None:
        """A pattern that cuts text at (and keeps) the tokenizer's special tokens, or
        None when piecewise encoding could differ from whole-text encoding."""
        if self._backend is None:
            return None
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        specials = []
        for tok in added.values():
            if getattr(tok, "lstrip", False) or getattr(tok, "rstrip", False):
                return None
            if getattr(tok, "normalized", False) or getattr(tok, "single_word", False):
                return None
            specials.append(str(tok.content))
        if not specials:
            return None
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        return re.compile(f"({alternatives})")

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens recognized, none added."""
        if self._split is None:
            return self._whole(text)
        out: list[int] = []
        for piece in self._split.split(text):
            if piece:
                out.extend(self._piece(piece))
        return out

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a chat rendered with the model's template, ready to generate."""
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        return self.encode_text(str(text))

    def encode_completion(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt, with the tokenizer's own special
        tokens (a BOS where the model wants one), as ``tokenizer(text)`` gives."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=True).ids)
        return [int(t) for t in self.tokenizer(text).input_ids]

    def _whole(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False).input_ids]

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return ids
        ids = self._whole(piece)
        with self._lock:
            self.misses += 1
            self._pieces[piece] = ids
            if len(self._pieces) > self._max:
                self._pieces.popitem(last=False)
        return ids

    def verified(self) -> bool:
        """Piecewise encoding equals whole-text encoding on a probe conversation (and
        on its plain text); False disables the piece cache for this tokenizer."""
        if getattr(self.tokenizer, "chat_template", None):
            try:
                text = str(
                    self.tokenizer.apply_chat_template(
                        _PROBE, add_generation_prompt=True, tokenize=False
                    )
                )
            except Exception:  # a template that refuses the probe's roles
                text = "".join(m["content"] for m in _PROBE)
        else:
            text = "".join(m["content"] for m in _PROBE)
        return self.encode_text(text) == self._whole(text)
