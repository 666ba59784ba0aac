"""The engine's device-generic path, on the CPU: the code a GPU runs, checked where CI runs.

Every tensor the adapter and the workers hand a store is on the model's device; a
prefix goes to the store as one ``batch_put`` of the rows of one contiguous staging
tensor, and comes back as one ``batch_get_into`` into the rows of one contiguous
tensor; no per-block call is made. The store is a real StoreNode behind NodeStore,
seen through a recorder that checks each call and passes it on.
(tests/gpu/test_engine_cuda.py runs the same workers on ``cuda``.)
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.blockstore import NodeStore
from engine.hf import blockio
from engine.hf.adapter import HFKVAdapter, model_device
from engine.hf.models import tiny_llama
from engine.hf.workers import DecodeWorker, PrefillWorker, greedy_continue
from engine.serving.loading import load_model, resolve_device
from engine.serving.stores import HandoffReader
from kvstore import StoreNode
from kvstore.errors import ConfigError, Unavailable
from tests.support.models import reference_tokens
from tests.support.recording_store import Recorder, rows_of_one_tensor

B = 16
N_NEW = 8
DEVICE = torch.device("cpu")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):  # type: ignore[no-untyped-def]
    return tiny_llama(request.param)


def _recorder(node: StoreNode, ad: HFKVAdapter) -> Recorder:
    return Recorder(NodeStore(node, ad.namespace), DEVICE)


def test_the_recorder_tells_one_staging_tensor_from_many() -> None:
    """Negative control for the checks below: separate tensors, or rows out of order,
    are not one batch."""
    a = torch.zeros(3, 4, 5)
    assert rows_of_one_tensor(list(a.unbind(0)))
    assert not rows_of_one_tensor([torch.zeros(4, 5), torch.zeros(4, 5)])
    assert not rows_of_one_tensor([a[0], a[2]])


def test_adapter_and_workers_live_on_the_models_device(model) -> None:  # type: ignore[no-untyped-def]
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    assert ad.device == model_device(model) == DEVICE
    ids = ad.input_ids([1, 2, 3])
    assert ids.device == DEVICE and ids.dtype == torch.long and ids.shape == (1, 3)


def test_a_prefix_moves_as_one_batch_each_way(model) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(75, seed=1)  # 4 full blocks and an 11-token tail
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with StoreNode(dram_bytes=8 << 20) as node:
        rec = _recorder(node, ad)
        h, cache = PrefillWorker(ad, rec).prefill_with_cache("r", p)
        # cold: the 4 full blocks in one batch, then the tail in one (request-scoped)
        assert rec.calls == [("batch_put", 4), ("batch_put", 1)]
        own = list(greedy_continue(model, cache, h.first_token, N_NEW))
        rec.calls.clear()
        dw = DecodeWorker(ad, rec)
        assert list(dw.decode(h, N_NEW)) == own
        assert rec.calls == [("batch_get_into", 5)]  # 4 shared blocks + the tail, one call
        rec.calls.clear()
        h2 = PrefillWorker(ad, rec).prefill("again", p)
        assert h2.stats.cached_blocks == 4
        assert rec.kinds() == ["batch_get_into", "batch_put"]  # the prefix; the tail
        assert "put" not in rec.kinds() and "get_into" not in rec.kinds()


def test_with_nothing_cached_the_handoff_equals_generate(model) -> None:  # type: ignore[no-untyped-def]
    p = _prompt(50, seed=2)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with StoreNode(dram_bytes=8 << 20) as node:
        rec = _recorder(node, ad)
        h = PrefillWorker(ad, rec).prefill("r", p)
        assert h.stats.cached_blocks == 0
        assert list(DecodeWorker(ad, rec).decode(h, N_NEW)) == reference_tokens(model, p, N_NEW)


def test_batches_are_cut_at_batch_keys(model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A prefix longer than a server's batch limit goes in slices (BATCH_KEYS each)."""
    monkeypatch.setattr(blockio, "BATCH_KEYS", 2)
    p = _prompt(90, seed=3)  # 5 full blocks
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with StoreNode(dram_bytes=8 << 20) as node:
        rec = _recorder(node, ad)
        PrefillWorker(ad, rec).prefill("r", p)
        assert rec.calls[:3] == [("batch_put", 2), ("batch_put", 2), ("batch_put", 1)]
        rec.calls.clear()
        n, _ = ad.load_prefix(rec, ad.keys(p), len(p))
        assert n == 5 and rec.calls == [("batch_get_into", 2)] * 2 + [("batch_get_into", 1)]
        node.remove([ad.keys(p)[2]])  # a gap ends the prefix, and the batches after it
        rec.calls.clear()
        n, _ = ad.load_prefix(rec, ad.keys(p), len(p))
        assert n == 2 and rec.calls == [("batch_get_into", 2)]


@pytest.mark.parametrize("tokens", [16, 37, 48])
def test_gather_and_rebuild_are_exact(model, tokens: int) -> None:  # type: ignore[no-untyped-def]
    """Blocks gathered from a cache and a cache rebuilt from them hold the very bytes;
    a partial last block is zero past its tokens, and the rebuild crops it."""
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with torch.inference_mode():
        cache = model(ad.input_ids(_prompt(tokens, seed=4)), use_cache=True).past_key_values
    staging = ad.gather_tokens(cache, 0, tokens)
    n = -(-tokens // B)
    assert staging.shape == (n, *ad.block_shape) and staging.is_contiguous()
    assert staging.device == DEVICE
    for li, layer in enumerate(cache.layers):
        for kv, src in ((0, layer.keys), (1, layer.values)):
            for j in range(n):
                t = min(B, tokens - j * B)
                assert torch.equal(staging[j, li, kv, :, :t], src[0, :, j * B : j * B + t])
                assert not staging[j, li, kv, :, t:].any()
    rebuilt = ad.cache_from_blocks(staging, tokens=tokens)
    for a, b in zip(rebuilt.layers, cache.layers, strict=True):
        assert a.keys.device == DEVICE and a.keys.is_contiguous()
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    full = tokens // B
    assert torch.equal(ad.gather(cache, 0, full), staging[:full])


def test_a_failed_batch_call_is_each_keys_error(model) -> None:  # type: ignore[no-untyped-def]
    """A batch that fails as a whole is a miss for each of its keys, never an exception
    past the keys already stored, and a read that fails ends the prefix there."""

    class Down(Recorder):
        def batch_put(self, keys: Any, values: Any, *, namespace: Any = None) -> list[Any]:
            raise Unavailable("node gone")

        def batch_get_into(self, keys: Any, outs: Any, **_kw: Any) -> list[Any]:
            raise Unavailable("node gone")

    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with StoreNode(dram_bytes=8 << 20) as node:
        down = Down(NodeStore(node, ad.namespace), DEVICE)
        blocks = torch.zeros((3, *ad.block_shape), dtype=ad.dtype)
        res = ad.put_blocks(down, ad.keys(_prompt(48, seed=5)), blocks)
        assert len(res) == 3 and all(isinstance(r, Unavailable) for r in res)
        assert ad.fetch_blocks(down, ad.keys(_prompt(48, seed=5)))[0] == 0
        pw = PrefillWorker(ad, down)
        h = pw.prefill("r", _prompt(40, seed=6))
        assert pw.store_errors >= 1 and h.shared_blocks == -1 and not h.scoped


def test_the_handoff_reader_reads_a_batch_in_two_calls(model) -> None:  # type: ignore[no-untyped-def]
    """The nearest replica first, the whole batch at once; then only its misses from
    the node written to, again at once."""
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    p = _prompt(64, seed=7)
    keys = ad.keys(p)
    with StoreNode(dram_bytes=8 << 20) as near, StoreNode(dram_bytes=8 << 20) as src:
        with torch.inference_mode():
            cache = model(ad.input_ids(p), use_cache=True).past_key_values
        blocks = ad.gather(cache, 0, 4)
        ad.put_blocks(src, keys, blocks)
        ad.put_blocks(near, keys[:2], blocks[:2])
        cluster, source = _recorder(near, ad), _recorder(src, ad)
        reader = HandoffReader(cluster, source)  # type: ignore[arg-type]
        got, buf = ad.fetch_blocks(reader, keys)
        assert got == 4 and torch.equal(buf, blocks)
        assert cluster.calls == [("batch_get_into", 4)] and source.calls == [("batch_get_into", 2)]
        assert (reader.from_cluster, reader.from_source) == (2, 2)


def test_worker_device_flag() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
    lm = load_model("tiny", "bf16", device="cpu")
    assert lm.device == torch.device("cpu") and lm.model.dtype == torch.bfloat16


def test_the_worker_cli_takes_device() -> None:
    import argparse

    from engine.serving.worker import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--role", "prefill"]).device is None
    assert p.parse_args(["--role", "prefill", "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        p.parse_args(["--role", "prefill", "--device", "gpu"])
