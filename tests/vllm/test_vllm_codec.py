"""KV compression through the vLLM connector, with real vLLM engines and a real
``kvstore serve`` process (run inside .venv-vllm; skipped where vLLM is not installed).

Engines, each its own process (tests/support/vllm_fixtures.py), fp32, the tiny random
Llama: a plain reference; for each codec (int8, fp8) a saver (kv_producer) and a loader
(kv_consumer) with ``kv_codec``; an uncompressed kv_both engine; and ``deq``, an
uncompressed consumer under a model id of its own, into whose namespace the test puts
the codec's reconstruction of a prompt's KV.

What "as close as the codec allows" means here, asserted in two halves:

* the saver stores exactly the codec's encoding of the prompt's canonical KV: decoded,
  every element is within the codec's rounding of the uncompressed engine's block
  (int8: half a step, scale / 2; fp8: 1/16 of the element, plus the subnormal step),
  and transformers' adapter with the same codec shares the namespace and decodes the
  same blocks;
* the loader attends to exactly that reconstruction: its greedy tokens equal those of
  ``deq``, an uncompressed engine loading the same decoded KV, token for token.

Tokens against the uncompressed reference are not asserted equal: a codec's rounding
may flip a near-tied greedy choice, and how often it does with real weights is what
benchmarks/bench_vllm_compress.py measures.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from kvstore import Namespace, prefix_keys
from kvstore.codec import get_codec
from tests.support.server_process import ALPHA, ServerProcess
from tests.support.vllm_fixtures import (
    BLOCK,
    EngineProcess,
    EngineSpec,
    prompt,
    start_engines,
    stop_engines,
    usable_blocks,
    write_tiny_llama,
)

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM runs in .venv-vllm (make test-vllm)", allow_module_level=True)

pytestmark = pytest.mark.slow

MODEL_ID = "tiny-llama-codec"
DEQ_ID = "tiny-llama-dequantized"
CODECS = ("int8", "fp8")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-codec")


@pytest.fixture(scope="module")
def model(root: Path) -> str:
    return str(write_tiny_llama(root / "model"))


@pytest.fixture(scope="module")
def hf_model(model: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def extra_for(store: ServerProcess, **more: str) -> dict[str, object]:
    return {
        "endpoint": store.address,
        "token": ALPHA.token,
        "model_id": MODEL_ID,
        "timeout_s": 2.0,
        "connect_timeout_s": 2.0,
        "retry_after_s": 1.0,
        **more,
    }


@pytest.fixture(scope="module")
def engines(model: str, root: Path, store: ServerProcess) -> Iterator[dict[str, EngineProcess]]:
    specs = {"ref": EngineSpec(model), "raw": EngineSpec(model, "float32", "kv_both",
             extra=extra_for(store)),
             "deq": EngineSpec(model, "float32", "kv_consumer",
             extra=extra_for(store, model_id=DEQ_ID))}  # fmt: skip
    for c in CODECS:
        specs[f"{c}_save"] = EngineSpec(model, "float32", "kv_producer",
                                        extra=extra_for(store, kv_codec=c))  # fmt: skip
        specs[f"{c}_load"] = EngineSpec(model, "float32", "kv_consumer",
                                        extra=extra_for(store, kv_codec=c))  # fmt: skip
    started = start_engines(specs, root, "ref")
    try:
        yield started
    finally:
        stop_engines(started)


def namespace_of(e: EngineProcess) -> Namespace:
    model, layout, tenant = e.info()["worker"]["namespace"]
    return Namespace(model, layout, tenant)


def worker(e: EngineProcess) -> dict[str, int]:
    return e.stats()["worker"]


def within_rounding(codec: str, decoded: torch.Tensor, raw: torch.Tensor) -> None:
    """Assert ``decoded`` is ``raw`` up to ``codec``'s rounding, per (layer, k|v, head):
    the scale is that head's absmax over the codec's largest value."""
    flat, got = raw.flatten(-2), decoded.flatten(-2)
    amax = flat.abs().amax(-1, keepdim=True)
    err = (got - flat).abs()
    # int8: half a step; e4m3: 3 mantissa bits (half an ulp is 1/16), subnormal steps of
    # scale / 512
    half_step = amax / 127 / 2
    bound = half_step if codec == "int8" else flat.abs() / 16 + amax / 448 / 512
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), float((err - bound).max())


@pytest.mark.parametrize("codec", CODECS)
def test_a_codec_loader_attends_to_the_codecs_reconstruction(
    engines: dict[str, EngineProcess], store: ServerProcess, hf_model: Any, codec: str
) -> None:
    seed = {"int8": 1, "fp8": 2}[codec]
    p = prompt(seed, 300)
    n = usable_blocks(len(p))
    saver, loader, deq = engines[f"{codec}_save"], engines[f"{codec}_load"], engines["deq"]
    ns = namespace_of(saver)
    assert ns == namespace_of(loader) and ns.layout.endswith(f":C{codec}")
    raw_ns = namespace_of(engines["raw"])
    assert ns.layout == f"{raw_ns.layout}:C{codec}"
    saver.generate([p], 1)
    engines["raw"].generate([p], 1)  # the same prompt's KV, uncompressed
    shape = raw_ns.kv_layout.block_shape()
    with store.client(namespace=ns) as c:
        keys = list(prefix_keys(p, BLOCK, ns))[:n]
        stored = torch.empty((n, ns.kv_layout.block_bytes()), dtype=torch.uint8)
        assert c.batch_get_into(keys, list(stored)) == [True] * n
    with store.client(namespace=raw_ns) as c:
        raw = torch.empty((n, *shape))
        assert c.batch_get_into(list(prefix_keys(p, BLOCK, raw_ns))[:n], list(raw)) == [True] * n
    layers, _, heads, _, _ = shape
    assert stored.shape[1] == raw[0].numel() + layers * 2 * heads * 4  # bytes + f32 scales
    decoded = get_codec(codec).decode(stored, torch.empty((n, *shape)))
    within_rounding(codec, decoded, raw)
    # transformers' adapter shares the namespace and reads the same blocks
    adapter = HFKVAdapter(hf_model, model_id=MODEL_ID, block_tokens=BLOCK, kv_codec=codec)
    assert adapter.namespace == ns
    with store.client(namespace=ns) as c:
        got, blocks = adapter.fetch_blocks(c, keys)
    assert got == n and torch.equal(blocks, decoded)

    deq_ns = namespace_of(deq)
    with store.client(namespace=deq_ns) as c:
        assert c.batch_put(list(prefix_keys(p, BLOCK, deq_ns))[:n], list(decoded)) == [True] * n
    before = worker(loader)
    out = loader.generate([p], 16)[0]
    want = deq.generate([p], 16)[0]
    assert out["cached"] == want["cached"] == n * BLOCK
    assert out["tokens"] == want["tokens"]
    after = worker(loader)
    assert after["loaded_blocks"] - before["loaded_blocks"] == n
    assert after["failed_blocks"] == before["failed_blocks"]
    assert after["layerwise_loads"] == 0  # a codec loads whole blocks


def test_engines_of_another_codec_or_none_miss(engines: dict[str, EngineProcess]) -> None:
    """Blocks saved under one codec are never read by an engine of another codec or of
    none: their namespaces differ, so the lookup misses (no load is even tried)."""
    p, q = prompt(3, 200), prompt(4, 200)
    n = usable_blocks(200) * BLOCK
    engines["int8_save"].generate([p], 1)
    engines["fp8_save"].generate([q], 1)
    others = ("fp8_load", "raw"), ("int8_load", "raw")
    for tokens, names in zip((p, q), others, strict=True):
        for name in names:
            e = engines[name]
            before = worker(e)
            assert e.generate([tokens], 4)[0]["cached"] == 0, name
            assert worker(e)["failed_blocks"] == before["failed_blocks"]
    # control: the same codec hits both
    assert engines["int8_load"].generate([p], 4)[0]["cached"] == n
    assert engines["fp8_load"].generate([q], 4)[0]["cached"] == n


def test_a_bad_codec_name_fails_at_engine_start(
    model: str, root: Path, store: ServerProcess
) -> None:
    spec = EngineSpec(model, "float32", "kv_both", extra=extra_for(store, kv_codec="int4"))
    e = EngineProcess(spec, root, "bad-codec")
    try:
        with pytest.raises(RuntimeError, match="unknown KV codec 'int4'; known: fp8, int8"):
            e.wait_ready()
    finally:
        e.close()
