"""benchmarks/gpu_ttft.py's measure_ttft through a StoreClient of a real `kvstore serve`
(the lead's bench_gpu.py calls it so on a GPU host), here on the CPU with a tiny
geometry: the prefix is fetched from the served store, the recompute side finds
nothing, the store keeps exactly the prefix, and the handoff is exact."""

from __future__ import annotations

import random

import torch

from benchmarks.gpu_ttft import TINY, measure_ttft
from engine.hf.adapter import HFKVAdapter
from engine.hf.models import random_llama
from tests.support.server_process import ALPHA, ServerProcess


def test_measure_ttft_through_a_served_store(store_server: ServerProcess) -> None:
    model = random_llama(TINY, dtype=torch.bfloat16)
    ad = HFKVAdapter(model, model_id=f"random-llama-{TINY.layers}L", block_tokens=16)
    with store_server.client(ALPHA, namespace=ad.namespace) as client:
        res = measure_ttft(
            "cpu", client, geometry=TINY, prompt_tokens=96, cached_tokens=64, runs=2,
            model=model, layer_parts=2,
        )  # fmt: skip
        assert res.tokens_equal
        assert res.cached_blocks == 4 and len(res.cached_samples) == 2
        assert len(res.layered_samples) == 2  # loaded beside the forward, through the server
        assert res.cached_ttft_s > 0 and res.recompute_ttft_s > 0
        assert res.block_bytes == ad.layout.block_bytes()
        rng = random.Random(0)  # measure_ttft's prompt (seed 0)
        keys = ad.keys([rng.randrange(TINY.vocab) for _ in range(96)])
        assert client.match_prefix(keys) == 4  # the store keeps exactly the prefix
    # the address form opens (and closes) its own client
    res = measure_ttft(
        "cpu", store_server.address, geometry=TINY, prompt_tokens=96, cached_tokens=64,
        runs=1, model=model, client_kwargs={"token": ALPHA.token},
    )  # fmt: skip
    assert res.tokens_equal
