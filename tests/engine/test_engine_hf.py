"""Disaggregated prefill/decode over a store node: token-identical to generate().

In process, against a real StoreNode (shared-memory DRAM, lmdb SSD) and a real
transformer. The separate-process version over the client SDK is in
tests/engine/test_engine_workers_process.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import DecodeWorker, PrefillWorker
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from tests.support.faults import flip_stored_bytes
from tests.support.models import reference_tokens, tiny_llama

B = 16
N_NEW = 12


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):  # type: ignore[no-untyped-def]
    return tiny_llama(request.param)


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    with StoreNode(node_id="e", dram_bytes=32 << 20) as n:
        yield n


def _run(model, store, prompt: list[int]) -> tuple[list[int], int, int]:  # type: ignore[no-untyped-def]
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    h = PrefillWorker(ad, store).prefill("r", prompt)
    dec = DecodeWorker(ad, store)
    toks = list(dec.decode(h, N_NEW))
    assert dec.first_token_mismatches == 0
    return toks, h.stats.cached_blocks, dec.last_loaded_blocks


def test_cold_then_full_prefix_hit(model, node) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(75)
    ref = reference_tokens(model, p, N_NEW)
    toks, cached, loaded = _run(model, node, p)
    assert toks == ref and cached == 0 and loaded == 4
    toks, cached, _ = _run(model, node, p)  # second time: the prefix comes from the store
    assert toks == ref and cached == 4


def test_partial_hit(model, node) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(100, seed=1)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with torch.inference_mode():
        out = model(torch.tensor([p[:40]]), use_cache=True)
    keys = ad.keys(p)
    ad.store_blocks(node, keys[:2], out.past_key_values, 0)  # only the first 2 blocks
    toks, cached, _ = _run(model, node, p)
    assert cached == 2 and toks == reference_tokens(model, p, N_NEW)


def test_shared_prefix_and_block_multiple(model, node) -> None:  # type: ignore[no-untyped-def]
    shared = _prompt(64, seed=2)
    a, b = shared + _prompt(20, seed=3), shared + _prompt(33, seed=4)
    _run(model, node, a)
    toks, cached, _ = _run(model, node, b)
    assert cached == 4 and toks == reference_tokens(model, b, N_NEW)
    exact = _prompt(64, seed=5)  # a multiple of the block size: last block recomputed
    _run(model, node, exact)
    toks, cached, _ = _run(model, node, exact)
    assert cached == 3 and toks == reference_tokens(model, exact, N_NEW)


def test_missing_middle_block_stops_the_prefix(model, node) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(90, seed=6)
    _run(model, node, p)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    node.remove([ad.keys(p)[2]])
    toks, cached, _ = _run(model, node, p)
    assert cached == 2 and toks == reference_tokens(model, p, N_NEW)


def test_wrong_bytes_would_change_output(model, node) -> None:  # type: ignore[no-untyped-def]
    """Negative control: KV that is not the model's own really changes the tokens,
    so the identity checks above would catch a store that served wrong bytes."""
    p = _prompt(80, seed=7)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with torch.inference_mode():  # real KV, but of another prompt
        out = model(torch.tensor([_prompt(80, seed=70)]), use_cache=True)
    blocks = ad.blocks_from_cache(out.past_key_values, 0, 4)
    for k, blk in zip(ad.keys(p), blocks, strict=False):
        node.put(k, blk, namespace=ad.namespace)
    h = PrefillWorker(ad, node).prefill("r", p)
    dec = DecodeWorker(ad, node)
    toks = list(dec.decode(h, N_NEW))
    assert toks != reference_tokens(model, p, N_NEW)


def test_corrupt_ssd_block_is_refused_and_output_identical(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(90, seed=8)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    blk_bytes = ad.layout.block_bytes() + 256
    with StoreNode(
        node_id="c", dram_bytes=2 * blk_bytes, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 << 20
    ) as n:
        _run(model, n, p)
        k0 = ad.keys(p)[0]
        assert n.tier_of(k0) is TierKind.SSD
        with torch.inference_mode():
            out = model(torch.tensor([p[:16]]), use_cache=True)
        first = ad.blocks_from_cache(out.past_key_values, 0, 1)[0]
        flip_stored_bytes(tmp_path / "ssd", first.reshape(-1).view(torch.uint8).numpy().tobytes())
        toks, cached, _ = _run(model, n, p)
        assert cached == 0  # the corrupt first block ends the prefix: nothing loaded
        assert n.counters.get("corrupt_blocks") == 1
        assert toks == reference_tokens(model, p, N_NEW)


def test_other_model_or_dtype_never_loads(node) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(80, seed=9)
    m32, m16 = tiny_llama(torch.float32), tiny_llama(torch.bfloat16)
    _run(m32, node, p)
    ad16 = HFKVAdapter(m16, model_id="tiny", block_tokens=B)
    assert node.match_prefix(ad16.keys(p)) == 0  # the dtype is in the namespace
    other = HFKVAdapter(tiny_llama(torch.float32, seed=1), model_id="tiny-2", block_tokens=B)
    assert node.match_prefix(other.keys(p)) == 0  # so is the model id
    # even under the right key, a block of another namespace is refused on read
    ad32 = HFKVAdapter(m32, model_id="tiny", block_tokens=B)
    out = torch.empty(ad32.block_shape)
    assert node.get_into(ad32.keys(p)[0], out, namespace=other.namespace) is False
