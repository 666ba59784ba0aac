"""A prefill whose stored prefix loads part by part beside its forward
(engine/hf/layerwise.py) computes exactly what one that fetched the prefix first does:
the same first token and the same cache, bit for bit, in fp32 and bf16, in process and
through a real ``kvstore serve`` (its ranged reads over shared memory and TCP). A part
that does not arrive never reaches a layer: the prompt is computed whole."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine.blockstore import BlockStore, NodeStore
from engine.hf.adapter import HFKVAdapter
from engine.hf.layerwise import _parts, decoder_layers
from engine.hf.workers import PrefillWorker
from kvstore import StoreNode
from kvstore.errors import KVStoreError, Unavailable
from tests.support.models import tiny_llama
from tests.support.server_process import ALPHA, ServerProcess


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # one reduction order for both prefills


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _same_cache(a: Any, b: Any) -> None:
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def _both(ad: HFKVAdapter, store: BlockStore, prompt: list[int]) -> None:
    """Store the prompt's blocks, then prefill it again both ways and compare."""
    PrefillWorker(ad, store).prefill("seed", prompt)
    whole = PrefillWorker(ad, store)
    layered = PrefillWorker(ad, store, layer_parts=3)
    assert layered.layer_parts == 3
    h1, c1 = whole.prefill_with_cache("w", prompt, handoff=False)
    h2, c2 = layered.prefill_with_cache("l", prompt, handoff=False)
    assert h2.stats.cached_blocks == h1.stats.cached_blocks == (len(prompt) - 1) // 16
    assert h2.first_token == h1.first_token
    _same_cache(c1, c2)
    assert layered.layerwise_misses == 0


def test_layer_parts_cover_the_depth_evenly() -> None:
    assert _parts(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    assert _parts(2, 4) == [(0, 1), (1, 2)]
    assert _parts(5, 1) == [(0, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_layerwise_prefill_is_the_whole_loads_in_process(dtype: torch.dtype) -> None:
    model = tiny_llama(dtype, layers=4)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    assert decoder_layers(model, 4) == list(model.model.layers)
    with StoreNode() as node:
        _both(ad, NodeStore(node, ad.namespace), _prompt(120, seed=3))


@pytest.mark.process
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_layerwise_prefill_is_the_whole_loads_through_the_server(
    store_server: ServerProcess, transport: str
) -> None:
    ad = HFKVAdapter(tiny_llama(torch.bfloat16, layers=4), model_id="tiny-lw", block_tokens=16)
    seed = 4 if transport == "shm" else 5
    with store_server.client(ALPHA, namespace=ad.namespace, transport=transport) as c:
        _both(ad, c, _prompt(150, seed=seed))


class _FaultyParts(NodeStore):
    """Ranged reads of layers from ``from_layer`` on raise ``error``, or without one miss
    their last block (evicted since it was matched)."""

    def __init__(
        self, node: StoreNode, namespace: Any, from_layer: int, error: BaseException | None = None
    ) -> None:
        super().__init__(node, namespace)
        self.from_layer, self.error = from_layer, error
        self.ranged: list[tuple[int, int]] = []

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Any = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        faulty = layers is not None and layers[0] >= self.from_layer
        if faulty and self.error is not None:
            raise self.error
        got = super().batch_get_into(keys, outs, namespace=namespace, layers=layers)
        if layers is not None:
            self.ranged.append(layers)
        if faulty:
            got[-1] = False
        return got


def test_a_part_that_misses_computes_the_prompt_whole() -> None:
    model = tiny_llama(torch.float32, layers=4)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    p = _prompt(100, seed=6)
    with StoreNode() as node:
        store = _FaultyParts(node, ad.namespace, from_layer=2)
        PrefillWorker(ad, store).prefill("seed", p[:80])
        cold, cold_cache = PrefillWorker(ad, StoreNode()).prefill_with_cache("c", p, handoff=False)
        pw = PrefillWorker(ad, store, layer_parts=2)
        h, cache = pw.prefill_with_cache("l", p, handoff=False)
        assert store.ranged == [(0, 2), (2, 4)]  # part 1 was read, and missed
        assert pw.layerwise_misses == 1 and h.stats.cached_blocks == 0
        assert h.first_token == cold.first_token
        _same_cache(cache, cold_cache)


@pytest.mark.parametrize(
    "error", [Unavailable("node gone"), SystemExit(3)], ids=["store-error", "not-an-exception"]
)
def test_a_loader_that_raises_never_lets_a_layer_read(error: BaseException) -> None:
    """Whatever ends the loader early (a store error, counted as one; even something
    that is not an Exception), the layers of the parts it did not land never run on
    them: the prompt is computed whole and its first token is the cold one's."""
    model = tiny_llama(torch.float32, layers=4)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=16)
    p = _prompt(100, seed=7)
    with StoreNode() as node:
        store = _FaultyParts(node, ad.namespace, from_layer=2, error=error)
        PrefillWorker(ad, store).prefill("seed", p)
        cold = PrefillWorker(ad, StoreNode()).prefill("c", p)
        pw = PrefillWorker(ad, store, layer_parts=2)
        h = pw.prefill("l", p)
        assert h.first_token == cold.first_token and h.stats.cached_blocks == 0
        assert pw.layerwise_misses == 1
        assert pw.store_errors == isinstance(error, KVStoreError)


def test_a_compressed_namespace_loads_whole() -> None:
    """The store has no layer ranges of a codec's blocks: such a worker fetches first."""
    ad = HFKVAdapter(tiny_llama(torch.float32), model_id="tiny", kv_codec="int8")
    with StoreNode() as node:
        assert PrefillWorker(ad, NodeStore(node, ad.namespace), layer_parts=4).layer_parts == 0
