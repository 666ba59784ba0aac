"""The engine on ``cuda``: prefill and decode workers over an in-process store, lossless.

The same workers and adapter as tests/engine/test_engine_device.py (which runs them on
the CPU), with a tiny random-weight Llama on the GPU and a real StoreNode behind
NodeStore, seen through a recorder that checks every tensor handed to the store is a
CUDA tensor and every batch is the rows of one contiguous CUDA tensor (so the engine
never stages a block through the host itself). Tokens are held to what the CPU tests
hold them to: the decode worker's equal the prefill worker's own continuation (bf16 and
fp32), and with nothing cached they equal ``generate()`` on the same device. Stored
bytes are compared exactly with the prefill worker's cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.blockstore import NodeStore
from engine.hf.adapter import HFKVAdapter
from engine.hf.models import tiny_llama
from engine.hf.workers import DecodeWorker, PrefillWorker, greedy_continue
from kvstore import StoreNode
from tests.support.recording_store import Recorder

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

B = 16
N_NEW = 16
CUDA = torch.device("cuda", 0)


def _model(dtype: torch.dtype, layers: int = 4) -> object:
    return tiny_llama(dtype, layers=layers).to(CUDA)


def _recorder(node: StoreNode, ad: HFKVAdapter) -> Recorder:
    return Recorder(NodeStore(node, ad.namespace), CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_on_cuda_equals_the_prefill_workers_own_continuation(dtype: torch.dtype) -> None:
    model = _model(dtype)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    assert ad.device.type == "cuda"
    rng = random.Random(7)
    with StoreNode(dram_bytes=64 << 20) as node:
        rec = _recorder(node, ad)
        pw, dw = PrefillWorker(ad, rec), DecodeWorker(ad, rec)
        shared = [rng.randrange(512) for _ in range(40)]
        prompts = [shared + [rng.randrange(512) for _ in range(n)] for n in (9, 24, 40, 57)]
        prompts += [prompts[1], shared[:32]]  # all cached (32: the last full block recomputed)
        for i, p in enumerate(prompts):
            h, cache = pw.prefill_with_cache(f"r{i}", p)
            assert all(layer.keys.device.type == "cuda" for layer in cache.layers)
            own = list(greedy_continue(model, cache, h.first_token, N_NEW))
            assert list(dw.decode(h, N_NEW)) == own, f"prompt {i} ({len(p)} tokens)"
            assert dw.last_loaded_blocks == h.shared_blocks
        assert dw.tail_recomputed == 0 and dw.first_token_mismatches == 0
        assert pw.store_errors == 0
        again = pw.prefill_with_cache("again", prompts[1])[0]
        assert again.stats.cached_blocks == 3 and again.shared_blocks == 3 and again.scoped
        kinds = set(rec.kinds())
        assert kinds == {"batch_put", "batch_get_into"}  # never a per-block call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_with_nothing_cached_decode_equals_generate_on_cuda(dtype: torch.dtype) -> None:
    model = _model(dtype)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    p = [random.Random(3).randrange(512) for _ in range(75)]
    ids = torch.tensor([p], device=CUDA)
    ref = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)  # type: ignore[attr-defined]
    with StoreNode(dram_bytes=64 << 20) as node:
        rec = _recorder(node, ad)
        h = PrefillWorker(ad, rec).prefill("r", p)
        assert h.stats.cached_blocks == 0
        got = list(DecodeWorker(ad, rec).decode(h, N_NEW))
    assert got == [int(t) for t in ref[0, len(p) :]]


def test_stored_blocks_are_the_cuda_caches_exact_bytes() -> None:
    model = _model(torch.bfloat16)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    p = [random.Random(4).randrange(512) for _ in range(70)]  # 4 full blocks + 6 tokens
    with StoreNode(dram_bytes=64 << 20) as node:
        h, cache = PrefillWorker(ad, _recorder(node, ad)).prefill_with_cache("r", p)
        keys = list(ad.keys(p)) + h.scoped_keys()
        back = torch.empty((len(keys), *ad.block_shape), dtype=ad.dtype)  # host, for the check
        for i, k in enumerate(keys):
            assert node.get_into(k, back[i], namespace=ad.namespace)
        for li, layer in enumerate(cache.layers):
            for kv, src in ((0, layer.keys), (1, layer.values)):
                host = src[0].cpu()  # [H, T, D]
                for j in range(len(keys)):
                    t = min(B, len(p) - j * B)
                    want = host[:, j * B : j * B + t]
                    assert torch.equal(
                        back[j, li, kv, :, :t].view(torch.int16), want.view(torch.int16)
                    )
                    assert not back[j, li, kv, :, t:].any()


def test_a_cached_prefix_is_rebuilt_on_cuda_from_one_tensor() -> None:
    model = _model(torch.bfloat16)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    p = [random.Random(5).randrange(512) for _ in range(90)]
    with StoreNode(dram_bytes=64 << 20) as node:
        rec = _recorder(node, ad)
        PrefillWorker(ad, rec).prefill("warm", p)
        rec.calls.clear()
        n, cache = ad.load_prefix(rec, ad.keys(p), len(p))
        assert n == 5 and rec.calls == [("batch_get_into", 5)]
        assert all(
            layer.keys.device.type == "cuda" and layer.values.device.type == "cuda"
            for layer in cache.layers
        )
        with torch.inference_mode():  # the prefill's own forward: all 90 tokens (a
            # forward of 80 may pick other kernels on CUDA, equal only to the last bits)
            whole = model(ad.input_ids(p), use_cache=True).past_key_values
        t = n * B
        for a, b in zip(cache.layers, whole.layers, strict=True):
            assert torch.equal(a.keys, b.keys[..., :t, :])
            assert torch.equal(a.values, b.values[..., :t, :])


def test_worker_defaults_to_cuda_and_calibrates_there() -> None:
    from engine.serving.loading import load_model, resolve_device
    from engine.serving.runtime import calibrate_prefill

    assert resolve_device(None).type == "cuda"
    lm = load_model("tiny", "bf16", device=resolve_device("cuda"))
    assert lm.device.type == "cuda"
    fit = calibrate_prefill(lm.model, 512, lm.max_context)
    assert all(c >= 0 for c in fit.coeffs)


class _SlowRebuild(NodeStore):
    """After each ranged read, a long kernel on the caller's (the loader's) stream: the
    loader's rebuild copies then land long after it returns, and only a layer that
    waits for its part's event on the device reads them."""

    def batch_get_into(self, keys, outs, *, namespace=None, layers=None):  # type: ignore[no-untyped-def]
        got = super().batch_get_into(keys, outs, namespace=namespace, layers=layers)
        if layers is not None:
            torch.cuda._sleep(20_000_000)
        return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_prefix_loaded_beside_the_forward_on_cuda_is_the_whole_loads(dtype: torch.dtype) -> None:
    """engine/hf/layerwise.py on the GPU: the loader copies on its own stream and each
    layer waits for its part's event on the device. The first token and every byte of
    the cache equal a prefill that fetched the prefix first; every landing is a CUDA
    tensor (the recorder checks)."""
    model = _model(dtype)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    p = [random.Random(8).randrange(512) for _ in range(150)]
    with StoreNode(dram_bytes=64 << 20) as node:
        rec = _recorder(node, ad)
        PrefillWorker(ad, rec).prefill("seed", p)
        h1, c1 = PrefillWorker(ad, rec).prefill_with_cache("w", p, handoff=False)
        layered = PrefillWorker(ad, rec, layer_parts=3)
        h2, c2 = layered.prefill_with_cache("l", p, handoff=False)
        assert layered.layer_parts == 3 and layered.layerwise_misses == 0
        slow = PrefillWorker(ad, _SlowRebuild(node, ad.namespace), layer_parts=3)
        h3, c3 = slow.prefill_with_cache("s", p, handoff=False)
    assert h3.stats.cached_blocks == h2.stats.cached_blocks == h1.stats.cached_blocks == 9
    assert h3.first_token == h2.first_token == h1.first_token
    for x, y, z in zip(c1.layers, c2.layers, c3.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        assert torch.equal(x.keys, z.keys) and torch.equal(x.values, z.values)


def test_measure_ttft_smoke_on_cuda() -> None:
    """benchmarks/gpu_ttft.py on the GPU with a tiny geometry and an in-process node:
    the same code the 1B measurement runs, its handoff exact."""
    from benchmarks.gpu_ttft import TINY, measure_ttft

    with StoreNode(dram_bytes=64 << 20) as node:
        res = measure_ttft(CUDA, node, geometry=TINY, prompt_tokens=256, cached_tokens=240,
                           runs=2, layer_parts=2)  # fmt: skip
    assert res.tokens_equal and res.cached_blocks == 15 and res.device.startswith("cuda")
    assert len(res.layered_samples) == 2
