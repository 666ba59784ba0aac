"""Disaggregated prefill and decode in separate processes, through a real server.

The parent starts `kvstore serve`; a prefill process and a decode process each load the
same weights and talk to the store only through StoreClient (shared memory on this
host). The decode process's greedy tokens must equal ordinary generate().
"""

from __future__ import annotations

import multiprocessing
import random

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import PrefillWorker
from tests.support import engine_procs
from tests.support.models import reference_tokens, tiny_llama
from tests.support.server_process import ALPHA, BRAVO, ServerProcess

N_NEW = 10


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _in_child(fn, *args):  # type: ignore[no-untyped-def]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_process_matches_generate(store_server: ServerProcess, dtype: str) -> None:
    shared = _prompt(48, seed=11 if dtype == "fp32" else 12)
    a = shared + _prompt(21, seed=13)
    b = shared + _prompt(40, seed=14)  # shares 3 blocks with a
    addr = store_server.address
    handoffs = _in_child(engine_procs.prefill, addr, ALPHA.token, dtype, [a, b])
    assert handoffs[0]["transport"] == "shm"
    assert handoffs[0]["stats"]["cached_blocks"] == 0
    assert handoffs[1]["stats"]["cached_blocks"] == 3  # b reused a's prefix across requests
    results = _in_child(engine_procs.decode, addr, ALPHA.token, dtype, handoffs, N_NEW)
    model = tiny_llama(torch.float32 if dtype == "fp32" else torch.bfloat16)
    for prompt, (toks, loaded, mismatches) in zip([a, b], results, strict=True):
        assert loaded == (len(prompt) - 1) // 16  # the decode side rebuilt from the store
        assert mismatches == 0
        assert toks == reference_tokens(model, prompt, N_NEW)


def test_other_tenant_gets_no_hits(store_server: ServerProcess) -> None:
    """Same model, same tokens, another tenant's token: no store hits."""
    p = _prompt(70, seed=15)
    ad = HFKVAdapter(tiny_llama(torch.float32), model_id="tiny", block_tokens=16)
    with store_server.client(ALPHA, namespace=ad.namespace) as alpha:
        PrefillWorker(ad, alpha).prefill("a", p)
        assert alpha.match_prefix(ad.keys(p)) == 4
    with store_server.client(BRAVO, namespace=ad.namespace) as bravo:
        assert PrefillWorker(ad, bravo).prefill("b", p).stats.cached_blocks == 0
