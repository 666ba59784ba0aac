"""The vLLM connector with KV caches other than a full-attention model's in its own
dtype: real vLLM engines (tests/support/vllm_fixtures.py) and a real ``kvstore serve``.

- An fp8 KV cache (``kv_cache_dtype="fp8"``): its pages are bytes the kernel wrote by
  arithmetic; the connector stores them as they are, as ``float8_e4m3fn`` blocks in
  canonical order (engine/vllm/paged.py). A consumer that loads a producer's fp8 blocks
  answers exactly as a plain fp8 engine does (greedy token ids), its hits are the
  store's, and the blocks live in a namespace of their own, which a full-precision
  engine of the same model never reads. vLLM runs an fp8 cache on CPU on x86 with
  AVX-512 or AMX only: elsewhere those tests are skipped.
- A sliding-window model (a Mistral whose every layer sees 64 tokens back): vLLM gives
  a request its null block for the blocks its window has left, so a failed load could
  not be recomputed; such an engine saves (never from the null block) and loads
  nothing.

Runs in .venv-vllm (``make test-vllm``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import Namespace, prefix_keys
from tests.support.server_process import ALPHA, ServerProcess
from tests.support.vllm_fixtures import (
    BLOCK,
    TINY,
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
FP8_ON_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
WINDOW = 64

pytestmark = pytest.mark.slow

MODEL_ID = "tiny-llama-fp8"
WINDOW_ID = "tiny-mistral-window"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-fp8")


def _three(model: str, extra: dict[str, object], **kw: str) -> dict[str, EngineSpec]:
    """A plain engine, a producer and a consumer of ``model``."""
    return {
        "ref": EngineSpec(model, **kw),  # type: ignore[arg-type]
        "prod": EngineSpec(model, role="kv_producer", extra=extra, **kw),  # type: ignore[arg-type]
        "cons": EngineSpec(model, role="kv_consumer", extra=extra, **kw),  # type: ignore[arg-type]
    }


def _extra(store: ServerProcess, model_id: str) -> dict[str, object]:
    return {"endpoint": store.address, "token": ALPHA.token, "model_id": model_id,
            "timeout_s": 2.0, "connect_timeout_s": 2.0}  # fmt: skip


@pytest.fixture(scope="module")
def engines(root: Path, store: ServerProcess) -> Iterator[dict[str, EngineProcess]]:
    """A plain fp8 engine, an fp8 producer and an fp8 consumer."""
    if not FP8_ON_CPU:
        pytest.skip("vLLM's fp8 KV cache on CPU needs AVX-512 or AMX")
    model = str(write_tiny_llama(root / "model"))
    specs = _three(model, _extra(store, MODEL_ID), kv_cache_dtype="fp8")
    started = start_engines({f"{k}8": v for k, v in specs.items()}, root / "fp8", "ref8")
    try:
        yield started
    finally:
        stop_engines(started)


@pytest.fixture(scope="module")
def window(root: Path, store: ServerProcess) -> Iterator[dict[str, EngineProcess]]:
    """A plain engine, a producer and a consumer of a sliding-window model."""
    model = str(write_tiny_llama(root / "mistral", sliding_window=WINDOW))
    specs = _three(model, _extra(store, WINDOW_ID))
    started = start_engines(specs, root / "window", "ref")
    try:
        yield started
    finally:
        stop_engines(started)


def namespace_of(e: EngineProcess) -> Namespace:
    model, layout, tenant = e.info()["worker"]["namespace"]
    return Namespace(model, layout, tenant)


def test_an_fp8_consumer_answers_as_a_plain_fp8_engine(engines: dict[str, EngineProcess]) -> None:
    p = prompt(31, 300)
    ref = engines["ref8"].generate([p], 16)[0]
    engines["prod8"].generate([p], 1)
    out = engines["cons8"].generate([p], 16)[0]
    assert out["tokens"] == ref["tokens"]
    assert out["cached"] == usable_blocks(300) * BLOCK
    assert engines["cons8"].stats()["worker"]["loaded_blocks"] >= usable_blocks(300)


def test_fp8_blocks_live_in_their_own_namespace(
    engines: dict[str, EngineProcess], store: ServerProcess
) -> None:
    """Stored as fp8 bytes, under a float8 layout: a full-precision engine of the same
    model (another layout) finds none of them."""
    ns = namespace_of(engines["prod8"])
    g = TINY
    geometry = f"L{g['layers']}:H{g['kv_heads']}:D{g['head_dim']}:B{BLOCK}:R0"
    assert ns.layout == f"float8_e4m3fn:{geometry}"
    p = prompt(32, 200)
    engines["prod8"].generate([p], 1)
    keys = list(prefix_keys(p, BLOCK, ns))
    full = Namespace(ns.model, ns.layout.replace("float8_e4m3fn", "float32"), ns.tenant)
    with store.client(namespace=ns) as c:
        assert c.match_prefix(keys) == len(keys) == 200 // BLOCK
        block = c.get(keys[0])
        assert block.dtype == torch.float8_e4m3fn
        assert tuple(block.shape) == (g["layers"], 2, g["kv_heads"], BLOCK, g["head_dim"])
        assert block.float().abs().max() > 0  # real KV, not a blank page
    with store.client(namespace=full) as c:
        assert c.match_prefix(list(prefix_keys(p, BLOCK, full))) == 0


def test_a_sliding_window_model_saves_but_does_not_load(
    window: dict[str, EngineProcess], store: ServerProcess
) -> None:
    """vLLM keeps no KV before a windowed request's window (its null block stands in):
    a load that failed could not be recomputed correctly, so such a consumer loads
    nothing and computes the prompt, answering as a plain engine. The producer saved
    every block, each while it was computed, none from the null block."""
    p = prompt(33, 300)
    ref = window["ref"].generate([p], 16)[0]
    window["prod"].generate([p], 1)
    ns = namespace_of(window["prod"])
    with store.client(namespace=ns) as c:
        assert c.match_prefix(list(prefix_keys(p, BLOCK, ns))) == 300 // BLOCK
        assert c.get(prefix_keys(p, BLOCK, ns)[0]).abs().max() > 0  # real KV, not block 0's
    out = window["cons"].generate([p], 16)[0]
    assert out["tokens"] == ref["tokens"]
    assert out["cached"] == 0
    assert window["cons"].stats()["worker"]["loaded_blocks"] == 0
