"""A compressed namespace end to end in process: a real StoreNode (DRAM and SSD) holds
the codec's bytes, the prefix is reused, and the continuation stays close.

int8 on the tiny model keeps every greedy token on these prompts (asserted exactly);
fp8 keeps the next-token logits close but the random-weight model amplifies its error
within a few tokens, so it is held to closeness, not token identity. The
SmolLM2 numbers (agreement over 50 prompts, perplexity) are benchmarks/bench_compress.py's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import greedy_continue
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from tests.support.faults import flip_stored_bytes
from tests.support.models import tiny_llama

B = 16
N_NEW = 12
SEEDS = range(4)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(70 + 7 * seed)]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):  # type: ignore[no-untyped-def]
    return tiny_llama(request.param)


@torch.inference_mode()
def _write(ad: HFKVAdapter, store: Any, prompt: list[int]) -> tuple[Any, list[int]]:
    """Compute the whole prompt and store its full blocks; returns the last logits and
    the greedy tokens of the uncompressed cache (what the compressed one is held to)."""
    out = ad.model(torch.tensor([prompt]), use_cache=True)
    ad.store_blocks(store, ad.keys(prompt), out.past_key_values, 0)
    logits = out.logits[0, -1].float()
    toks = list(greedy_continue(ad.model, out.past_key_values, int(logits.argmax()), N_NEW))
    return logits, toks


@torch.inference_mode()
def _reuse(ad: HFKVAdapter, store: Any, prompt: list[int]) -> tuple[int, Any, list[int]]:
    """Prefill with the stored prefix: (blocks loaded, last logits, greedy tokens)."""
    n, cache = ad.load_prefix(store, ad.keys(prompt), len(prompt))
    out = ad.model(torch.tensor([prompt[n * B :]]), past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1].float()
    toks = list(greedy_continue(ad.model, out.past_key_values, int(logits.argmax()), N_NEW))
    return n, logits, toks


def test_int8_prefix_reused_with_exact_tokens(model) -> None:  # type: ignore[no-untyped-def]
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec="int8")
    with StoreNode(node_id="c", dram_bytes=8 << 20) as node:
        for seed in SEEDS:
            p = _prompt(seed)
            full, ref = _write(ad, node, p)
            before = node.counters.get("bytes_out")
            n, logits, toks = _reuse(ad, node, p)
            assert n == (len(p) - 1) // B
            assert node.counters.get("bytes_out") - before == n * ad.stored_block_bytes
            assert toks == ref
            assert torch.cosine_similarity(logits, full, dim=0) > 0.9995


def test_fp8_prefix_reused_and_close(model) -> None:  # type: ignore[no-untyped-def]
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec="fp8")
    first_agree = 0
    with StoreNode(node_id="c", dram_bytes=8 << 20) as node:
        for seed in SEEDS:
            p = _prompt(seed)
            full, ref = _write(ad, node, p)
            n, logits, toks = _reuse(ad, node, p)
            assert n == (len(p) - 1) // B
            assert torch.cosine_similarity(logits, full, dim=0) > 0.998
            first_agree += toks[0] == ref[0]
    assert first_agree >= 3


def test_compressed_bytes_are_what_every_tier_holds(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The store is given, keeps and checksums the codec's bytes: one byte per element
    and a float32 scale per (layer, k|v, head)."""
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec="int8")
    assert ad.namespace.layout.endswith(":Cint8")
    layers, _, heads, _, _ = ad.block_shape
    elements = ad.layout.raw_block_bytes() // model.dtype.itemsize
    assert ad.stored_block_bytes == ad.layout.block_bytes() == elements + 4 * layers * 2 * heads
    p = _prompt(7)
    blk = ad.stored_block_bytes + 256
    with StoreNode(
        node_id="c", dram_bytes=2 * blk, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 << 20
    ) as node:
        _write(ad, node, p)
        keys = ad.keys(p)
        assert node.tier_of(keys[0]) is TierKind.SSD
        stored = node.get(keys[0], namespace=ad.namespace)
        assert isinstance(stored, bytes) and len(stored) == ad.stored_block_bytes


@pytest.mark.parametrize("at", [10, 400], ids=["scales", "values"])
def test_corrupt_compressed_ssd_block_is_a_miss(model, tmp_path: Path, at: int) -> None:  # type: ignore[no-untyped-def]
    """A flipped byte of a compressed block on SSD fails the store's checksum (taken
    over the compressed bytes): the prefix ends there and the output is the
    recomputed one, never KV decoded from wrong bytes."""
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec="fp8")
    assert ad.codec is not None
    p = _prompt(8)
    blk = ad.stored_block_bytes + 256
    with StoreNode(
        node_id="c", dram_bytes=2 * blk, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 << 20
    ) as node:
        _, ref = _write(ad, node, p)
        k0 = ad.keys(p)[0]
        assert node.tier_of(k0) is TierKind.SSD
        with torch.inference_mode():
            out = ad.model(torch.tensor([p[:B]]), use_cache=True)
        first = ad.blocks_from_cache(out.past_key_values, 0, 1)[0]
        payload = ad.codec.encode(first).numpy().tobytes()  # deterministic: the stored bytes
        flip_stored_bytes(tmp_path / "ssd", payload, at=at)
        n, _, toks = _reuse(ad, node, p)
        assert n == 0  # the corrupt first block ends the prefix: nothing loaded
        assert node.counters.get("corrupt_blocks") == 1
        assert toks == ref  # computed from scratch: the uncompressed cache's own tokens


def test_compressed_and_raw_namespaces_never_mix(model) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(9)
    raw = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    spaces = {
        c: HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec=c) for c in ("fp8", "int8")
    }
    with StoreNode(node_id="c", dram_bytes=8 << 20) as node:
        _write(spaces["int8"], node, p)
        assert node.match_prefix(spaces["int8"].keys(p)) == len(p) // B
        assert node.match_prefix(raw.keys(p)) == 0
        assert node.match_prefix(spaces["fp8"].keys(p)) == 0
        # Even under the int8 key, another namespace's read is refused, never decoded.
        k0 = spaces["int8"].keys(p)[0]
        out = torch.empty(raw.block_shape, dtype=raw.dtype)
        assert not spaces["fp8"].get_block(node, k0, out)
        assert not raw.get_block(node, k0, out)
        assert spaces["int8"].get_block(node, k0, out)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_compressed_prefix_decodes_straight_into_the_cache(model, codec: str) -> None:  # type: ignore[no-untyped-def]
    """load_cache decodes the codec's bytes straight into the cache's tensors: the same
    keys and values, bit for bit, as decoding into blocks and copying them into a cache,
    cropped alike to a padded last block."""
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec=codec)
    p = _prompt(10)
    with StoreNode(node_id="c", dram_bytes=8 << 20) as node:
        with torch.inference_mode():
            out = ad.model(torch.tensor([p]), use_cache=True)
        keys = [*ad.keys(p), b"\x01" * 16]  # and one key for the padded tail
        ad.put_blocks(node, keys, ad.gather_tokens(out.past_key_values, 0, len(p)))
        got, blocks = ad.fetch_blocks(node, keys)
        want = ad.cache_from_blocks(blocks, tokens=len(p))
        n, cache = ad.load_cache(node, keys, tokens=len(p))
        assert n == got == len(keys) and len(p) % B
        for a, b in zip(cache.layers, want.layers, strict=True):
            assert a.keys.shape == b.keys.shape and a.keys.shape[2] == len(p)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        n, partial = ad.load_cache(node, [*keys[:2], b"\x00" * 16], tokens=len(p))
        assert n == 2 and partial.layers[0].keys.shape[2] == 2 * B  # a miss ends it, uncropped
