"""The handoff is lossless with real weights in bf16: SmolLM2-135M-Instruct, 8 chat
prompts, through a real ``kvstore serve``.

This is the case that broke before the request-scoped tail blocks: recomputing the
partial tail on the decode side against the cached prefix can round differently from
the prefill's pass (4 of 8 SmolLM2 chat prompts diverged on the reporter's machine).
Whether that naive path diverges depends on the CPU's bf16 GEMM kernels: on a 2-core
avx512_bf16 Xeon without AMX it matched on these 8 prompts, so this test guards the
exact path on the machines where the difference shows. Prompts share a system
message, so the later ones reuse stored blocks that another request computed (the
"stored copy came from another computation" case of engine/hf/workers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import DecodeWorker, PrefillWorker, greedy_continue
from tests.support.server_process import ALPHA, ServerProcess

pytest.importorskip("gguf")
N_NEW = 24
SYSTEM = (
    "You are a careful assistant for the operators of an LLM serving cluster. Answer in "
    "two or three sentences, plainly, and say when you are not sure."
)
QUESTIONS = [
    "What is a KV cache?",
    "Why would a router send a request to the worker that already holds its prefix?",
    "Explain prefill and decode in one paragraph.",
    "What happens when host memory is full and a new block must be stored?",
    "Is shared memory faster than TCP on one host? Why?",
    "How should a cache behave when a node holding a block dies?",
    "Name two ways to make time to first token shorter.",
    "What does a checksum protect against in a block store?",
]


@pytest.fixture(scope="module")
def smollm2_bf16() -> Iterator[tuple[Any, Any]]:
    from engine.hf.models import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: one reduction order on both sides
    try:
        yield load_smollm2(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)


def test_smollm2_bf16_decode_equals_prefill_continuation(
    store_server: ServerProcess, smollm2_bf16: tuple[Any, Any]
) -> None:
    model, tok = smollm2_bf16
    ad = HFKVAdapter(model, model_id="smollm2-135m", block_tokens=16)
    stop = {int(tok.eos_token_id)}
    with (
        store_server.client(ALPHA, namespace=ad.namespace) as pstore,
        store_server.client(ALPHA, namespace=ad.namespace) as dstore,
    ):
        pw, dw = PrefillWorker(ad, pstore), DecodeWorker(ad, dstore)
        reused = 0
        for i, q in enumerate(QUESTIONS):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = [int(t) for t in tok(text, add_special_tokens=False).input_ids]
            h, cache = pw.prefill_with_cache(f"smol-{i}", ids)
            reused += h.stats.cached_blocks > 0
            own = list(greedy_continue(model, cache, h.first_token, N_NEW, stop))
            assert list(dw.decode(h, N_NEW, stop)) == own, f"prompt {i} ({len(ids)} tokens)"
        assert reused >= len(QUESTIONS) - 1  # the shared system prompt came from the store
        assert dw.tail_recomputed == 0 and dw.first_token_mismatches == 0
        assert pw.store_errors == 0
