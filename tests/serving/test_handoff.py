"""The prefill -> decode handoff is lossless: the decode worker continues from the
prefill worker's KV bit for bit, so its tokens equal the prefill worker's own
continuation, in fp32 and in bf16 (in process, through a real StoreNode)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.models import tiny_llama
from engine.hf.workers import DecodeWorker, PrefillWorker, greedy_continue, store_answer
from kvstore import StoreNode

N_NEW = 16


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the workers' setting: one reduction order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_equals_the_prefill_workers_own_continuation(dtype: torch.dtype) -> None:
    model = tiny_llama(dtype, layers=4)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    rng = random.Random(7)
    with StoreNode() as node:
        pw, dw = PrefillWorker(ad, node), DecodeWorker(ad, node)
        shared = [rng.randrange(512) for _ in range(40)]
        prompts = [shared + [rng.randrange(512) for _ in range(n)] for n in (9, 24, 40, 57)]
        prompts += [prompts[1], shared[:32]]  # all cached (32: the last full block recomputed)
        for i, p in enumerate(prompts):
            h, cache = pw.prefill_with_cache(f"r{i}", p)
            own = list(greedy_continue(model, cache, h.first_token, N_NEW))
            assert list(dw.decode(h, N_NEW)) == own, f"prompt {i} ({len(p)} tokens)"
            assert dw.last_loaded_blocks == h.shared_blocks
        assert dw.tail_recomputed == 0 and dw.first_token_mismatches == 0
        # the repeated prompt (64 tokens) reused its stored prefix: all but the last block,
        # which is recomputed for its logits and handed over request-scoped
        again = pw.prefill_with_cache("again", prompts[1])[0]
        assert again.stats.cached_blocks == 3 and again.shared_blocks == 3 and again.scoped


def test_a_missing_request_scoped_block_recomputes_and_says_so() -> None:
    model = tiny_llama(torch.float32)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    p = [random.Random(8).randrange(512) for _ in range(45)]
    with StoreNode() as node:
        h, cache = PrefillWorker(ad, node).prefill_with_cache("r", p)
        assert h.scoped and h.shared_blocks == 2
        node.remove(h.scoped_keys())  # lost (evicted, node gone): a miss, not a failure
        dw = DecodeWorker(ad, node)
        own = list(greedy_continue(model, cache, h.first_token, N_NEW))
        assert list(dw.decode(h, N_NEW)) == own  # fp32: the recompute is exact
        assert dw.tail_recomputed == 1


def test_a_whole_answer_is_stored_for_the_next_turn() -> None:
    """store_answer (``kvstore worker --save-decode``): a decode's cache holds the prompt
    and the answer but its last token; those full blocks past the prompt's are stored
    under the chain of prompt and answer. A next turn repeating the answer loads them,
    and its handoff decodes as its own continuation. A cache of another length (a cut
    answer, another request's) stores nothing."""
    model = tiny_llama(torch.float32)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    rng = random.Random(9)
    p = [rng.randrange(512) for _ in range(40)]
    with StoreNode() as node:
        pw, dw = PrefillWorker(ad, node), DecodeWorker(ad, node)
        answer = list(dw.decode(pw.prefill("r1", p), 30))  # the cache: 40 + 29 tokens
        assert store_answer(ad, node, p, answer[:10], dw.last_cache) == 0
        assert store_answer(ad, node, p, answer, dw.last_cache) == 4 - 2  # blocks 2, 3
        assert store_answer(ad, node, p, answer, dw.last_cache) == 0  # stored already
        nxt = p + answer + [rng.randrange(512) for _ in range(20)]
        with torch.no_grad():  # the answer's blocks hold its KV: a cold forward's, in fp32
            cold = model(torch.tensor([nxt[:64]]), use_cache=True).past_key_values
        for i, want in enumerate(ad.blocks_from_cache(cold, 2, 4), 2):
            torch.testing.assert_close(node.get(ad.keys(nxt)[i]), want, atol=1e-4, rtol=1e-4)
        h, cache = pw.prefill_with_cache("r2", nxt)
        assert h.stats.cached_blocks == 4
        own = list(greedy_continue(model, cache, h.first_token, N_NEW))
        assert list(DecodeWorker(ad, node).decode(h, N_NEW)) == own
