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

A long new message is tokenized only as far as routing needs (:meth:`encode_until`):
the router walks it a chunk at a time, cut where a word starts, and stops at the first
full block that no store node holds, since no longer prefix can match past it. The
prefill worker tokenizes the rest (the same encoder, so ``ids + encode_text(rest)``
equals ``encode_text(text)``; verified at load on cut probes, or laziness is off) and
returns the whole prompt, which :meth:`learn` files as pieces, so the conversation's
next turn finds this message cached here.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PromptEncoder"]

_PROBE = [
    {"role": "system", "content": "You answer briefly.\n"},
    {"role": "user", "content": "  Where is the cache?  Tell me — in detail.\n\n"},
    {"role": "assistant", "content": "In DRAM, then on SSD.  "},
    {"role": "user", "content": "And the keys? (hex: 0x1f, tabs:\t)"},
]


_CUT_PROBE = (
    "The router sends each request to the prefill worker that holds its longest prefix. "
    "It's 3.5x faster (p50: 107ms vs 140 ms) -- isn't it?  Numbers like 4096, 65536 and "
    "1e-3 stay whole; so do don't, we'll and o'clock. Emoji \u2728 and accents caf\u00e9 "
    "na\u00efve Stra\u00dfe, tabs\tand\nnew lines,   runs of   spaces, (brackets) "
    "[lists], {json: true}, path/to/file.py, user@example.com, and CamelCaseWords end it."
)


class PromptEncoder:
    """Encodes prompts for one tokenizer; thread-safe; a bounded cache of pieces.

    ``lazy_min_chars``: a new piece at least this long is tokenized chunk by chunk by
    :meth:`encode_until` (``chunk_chars`` a chunk); shorter ones are encoded whole.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_pieces: int = 8192,
        chunk_chars: int = 1024,
        lazy_min_chars: int = 2048,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._max = max_pieces
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._split: re.Pattern[str] | None = self._splitter()
        self._specials: dict[str, int] = self._special_ids()
        self._special_set = frozenset(self._specials.values())
        self.chunk_chars, self.lazy_min_chars = chunk_chars, lazy_min_chars
        self.hits = self.misses = 0
        if self._split is not None and not self.verified():
            self._split = None
        self.lazy = self._split is not None and self._cuts_verified()

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

    def _special_ids(self) -> dict[str, int]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return {str(tok.content): int(i) for i, tok in added.items()}

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens recognized, none added."""
        if self._split is None:
            return self._whole(text)
        out: list[int] = []
        for piece in self._split.split(text):
            if piece:
                out.extend(self._piece(piece))
        return out

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """A chat rendered with the model's template, ready to generate."""
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a chat rendered with the model's template, ready to generate."""
        return self.encode_text(self.render_chat(messages))

    def encode_until(
        self, text: str, keep_going: Callable[[list[int]], bool]
    ) -> tuple[list[int], str]:
        """``(ids, rest)``: the ids of ``text`` up to where ``keep_going(ids)`` first said
        no, and the text not encoded. ``keep_going`` is asked before each chunk of a
        long new piece (never for cached or short pieces), so ``rest`` starts at a
        piece boundary or where a word starts; ``ids + encode_text(rest)`` equals
        ``encode_text(text)``. Without verified cuts, the whole text and ``""``."""
        if not self.lazy or self._split is None:
            return self.encode_text(text), ""
        out: list[int] = []
        offset = 0
        for piece in self._split.split(text):
            if not piece:
                continue
            with self._lock:
                cached = self._pieces.get(piece)
            if cached is not None or len(piece) < self.lazy_min_chars:
                out.extend(cached if cached is not None else self._piece(piece))
                offset += len(piece)
                continue
            start, ids = 0, []
            while start < len(piece):
                if not keep_going(out):
                    return out, text[offset + start :]
                cut = self._cut(piece, start + self.chunk_chars)
                part = self._whole(piece[start:cut])
                ids.extend(part)
                out.extend(part)
                start = cut
            self._remember(piece, ids)
            offset += len(piece)
        return out, ""

    def learn(self, text: str, ids: Sequence[int]) -> bool:
        """File the pieces of ``text`` (whose ids, e.g. from a worker, are ``ids``) in
        the cache; False, caching nothing, when the ids do not line up with the pieces
        at the special tokens."""
        if self._split is None:
            return False
        staged: list[tuple[str, list[int]]] = []
        pos = 0
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = self._specials.get(piece)
            if sid is not None:
                if pos >= len(ids) or ids[pos] != sid:
                    return False
                pos += 1
                continue
            end = pos
            while end < len(ids) and ids[end] not in self._special_set:
                end += 1
            staged.append((piece, [int(t) for t in ids[pos:end]]))
            pos = end
        if pos != len(ids):
            return False
        for piece, pids in staged:
            self._remember(piece, pids)
        return True

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
        self._remember(piece, ids)
        return ids

    def _remember(self, piece: str, ids: list[int]) -> None:
        with self._lock:
            self._pieces[piece] = ids
            self._pieces.move_to_end(piece)
            if len(self._pieces) > self._max:
                self._pieces.popitem(last=False)

    @staticmethod
    def _cut(piece: str, at: int) -> int:
        """The first place at or after ``at`` where a word starts after a single space
        (``"x y"``: before the space), or the piece's end."""
        n = len(piece)
        i = max(at, 1)
        while i < n - 1:
            if piece[i] == " " and not piece[i - 1].isspace() and piece[i + 1].isalnum():
                return i
            i += 1
        return n

    def _cuts_verified(self) -> bool:
        """Encoding either side of every cut :meth:`_cut` can choose in a probe equals
        encoding the whole (pre-tokenizers that split before a space do; a metaspace
        one that prepends a marker to every text does not)."""
        text = _CUT_PROBE
        whole = self._whole(text)
        at = 1
        while (cut := self._cut(text, at)) < len(text):
            if self._whole(text[:cut]) + self._whole(text[cut:]) != whole:
                return False
            at = cut + 1
        return True

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
