"""The vLLM connector's KV compression without an engine: its config, the codec bound to
the KV device (engine/vllm/compress.py), and a step's compressed loads and saves over a
real in-process StoreNode and real page tensors. Runs in the main environment; the
worker-side test needs vLLM (.venv-vllm)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import numpy as np
import pytest
import torch

from engine.blockstore import GuardedStore, NodeStore
from engine.vllm.compress import BlockCodec
from engine.vllm.loads import BlockTransfer, StepLoad
from engine.vllm.paged import PagedKV, known_layouts
from engine.vllm.store import ConnectorConfig, ConnectorStats
from kvstore import Namespace, StoreNode, prefix_keys
from kvstore.codec import get_codec
from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.layout import KVLayout

RAW = "float32:L2:H2:D32:B32:R0"
VLLM_LOG = logging.getLogger("vllm.kvstore")
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM runs in .venv-vllm (make test-vllm)"
)


# -- config ------------------------------------------------------------------------------


def test_a_codec_turns_the_layerwise_defaults_off_and_is_canonical() -> None:
    c = ConnectorConfig.from_extra({"endpoint": "h:1", "kv_codec": "E4M3"})
    assert (c.kv_codec, c.layerwise, c.layerwise_save) == ("fp8", False, False)
    raw = ConnectorConfig.from_extra({"endpoint": "h:1", "kv_codec": "none"})
    assert (raw.kv_codec, raw.layerwise, raw.layerwise_save) == ("", True, True)
    assert ConnectorConfig.from_extra({"endpoint": "h:1"}).kv_codec == ""


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"kv_codec": "int4"}, "unknown KV codec 'int4'; known: fp8, int8"),
        ({"kv_codec": 8}, "kv_codec.*expected str"),
        ({"kv_codec": "int8", "layerwise": True}, "no layer ranges.*layerwise"),
        ({"kv_codec": "fp8", "layerwise_save": True}, "no layer ranges.*layerwise"),
    ],
)
def test_a_bad_codec_or_a_layerwise_codec_fails_at_start(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra({"endpoint": "h:1", **extra})


# -- the codec on the KV device -----------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_codec_round_trips_as_the_codec_does(name: str, dtype: torch.dtype) -> None:
    layout = KVLayout.parse(RAW)
    bc = BlockCodec(name, layout, dtype, "cpu")
    blocks = torch.randn(3, *layout.block_shape()).to(dtype)
    rows = bc.encode(blocks)
    want = get_codec(name).encode(blocks)
    assert [bytes(r) for r in rows] == [bytes(want[i].numpy().data) for i in range(3)]
    land = bc.landing(3)
    for i, r in enumerate(rows):
        land[i].copy_(torch.frombuffer(bytearray(r), dtype=torch.uint8))
    out = torch.empty_like(blocks)
    assert bc.decode(land, out) == [True, True, True]
    assert torch.equal(out, get_codec(name).decode(want, torch.empty_like(blocks)))


def test_a_device_the_codec_cannot_run_on_fails_at_start() -> None:
    """The meta device runs every op of the encode but holds no data: the probe cannot
    read a result there, so the worker refuses to start rather than run elsewhere."""
    with pytest.raises(ConfigError, match=r"kv_codec 'int8' cannot run on .* device meta"):
        BlockCodec("int8", KVLayout.parse(RAW), torch.float32, "meta")


def test_blocks_the_codec_refuses_are_left_out_of_the_batch() -> None:
    layout = KVLayout.parse(RAW)
    bc = BlockCodec("int8", layout, torch.float32, "cpu")
    blocks = torch.randn(3, *layout.block_shape())
    blocks[1, 1, 0, 1, 5, 7] = float("nan")
    rows = bc.encode(blocks)
    assert rows[1] is None and rows[0] is not None and rows[2] is not None
    assert bytes(rows[2]) == bytes(get_codec("int8").encode(blocks[2]).numpy().data)
    blocks[0, 0, 1, 0, 0, 0] = float("inf")
    assert bc.encode(blocks[:2]) == [None, None]


# -- a step's compressed loads --------------------------------------------------------------


def guarded(store: Any) -> GuardedStore:
    gs = GuardedStore(lambda: store, retry_after_s=5.0, stats=ConnectorStats(),
                      spawn=lambda fn: fn(), logger=VLLM_LOG)  # fmt: skip
    assert gs.open()
    return gs


def empty_pages(layout: KVLayout, pages: int) -> tuple[list[torch.Tensor], PagedKV]:
    """vLLM CPU-backend tensors (vec order) and the connector's view of them."""
    H, B, D = layout.kv_heads, layout.block_tokens or 0, layout.head_dim
    tensors = [torch.zeros(pages, H, B, 2 * D) for _ in range(layout.layers)]
    return tensors, PagedKV(tensors, layout, known_layouts(B, D, 4)[0])


def bad_scale(encoded: torch.Tensor) -> bytes:
    """A block's bytes whose first scale is negative: no codec writes that, and the
    store's checksum (taken over these bytes) cannot catch it."""
    raw = encoded.clone()
    raw[:4].view(torch.float32)[0] = -1.0
    return bytes(raw.numpy().data)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_steps_compressed_loads_decode_before_the_scatter(name: str) -> None:
    """Stored codec bytes land, decode and scatter: the pages hold exactly the codec's
    reconstruction; a block whose bytes do not decode fails like a miss (its request
    loads the blocks before it), and its key is offered for removal."""
    ns = Namespace("tiny-codec", f"{RAW}:C{name}")
    layout = ns.kv_layout
    codec = get_codec(name)
    blocks = torch.randn(5, *layout.block_shape())
    enc = codec.encode(blocks)
    keys = list(prefix_keys(range(5 * 32), 32, ns))
    with StoreNode(dram_bytes="4MiB") as node:
        values: list[Any] = [bytes(enc[i].numpy().data) for i in range(4)]
        values[3] = bad_scale(enc[3])  # keys[4] is never stored
        assert node.batch_put(keys[:4], values, namespace=ns) == [True] * 4
        with pytest.raises(LayoutMismatch, match=f"{name}-compressed"):  # raw blocks: refused
            node.put(keys[4], blocks[4], namespace=ns)
        gs = guarded(NodeStore(node, ns))
        _, paged = empty_pages(layout, 8)
        bc = BlockCodec(name, layout, torch.float32, "cpu")
        items = [BlockTransfer("a", keys[:2], [5, 6]), BlockTransfer("b", keys[2:], [0, 3, 1])]
        with pytest.raises(ValueError, match="load whole"):
            StepLoad(items, gs, paged, chunk=2, executor=object(), codec=bc)  # type: ignore[arg-type]
        step = StepLoad(items, gs, paged, chunk=2, executor=None, codec=bc)
        assert [(it.req_id, good) for it, good in step.outcome()] == [("a", 2), ("b", 1)]
        assert step.failed_keys() == [keys[3], keys[4]]
    want = codec.decode(enc[:3], torch.empty(3, *layout.block_shape()))
    assert torch.equal(paged.gather([5, 6, 0]), want)


# -- the worker side: gather -> encode -> put, land -> decode -> scatter --------------------


@needs_vllm
@pytest.mark.process  # importing vLLM's connector base runs `file` (py-cpuinfo)
def test_the_worker_side_saves_codec_bytes_and_loads_them_back() -> None:
    from engine.vllm.scheduler_side import KVStoreConnectorMetadata
    from engine.vllm.worker_side import WorkerSide

    ns = Namespace("tiny-worker", f"{RAW}:Cint8")
    layout = ns.kv_layout
    config = ConnectorConfig.from_extra(
        {"endpoint": "h:1", "kv_codec": "int8", "transfer_cpus": "none", "max_blocks_per_call": 2}
    )
    blocks = torch.randn(3, *layout.block_shape())
    blocks[2, 0, 0, 0, 0, 0] = float("nan")  # refused: never stored
    keys = list(prefix_keys(range(3 * 32), 32, ns))
    with StoreNode(dram_bytes="4MiB") as node:
        gs = guarded(NodeStore(node, ns))
        saver = WorkerSide(config, ns, gs, ConnectorStats(), load_enabled=True, save_enabled=True)
        src, paged = empty_pages(layout, 6)
        paged.scatter(blocks, [4, 1, 2])
        names = [f"layer.{i}" for i in range(layout.layers)]
        saver.register(dict(zip(names, src, strict=True)), names, paged.page)
        assert saver.codec is not None and saver.codec.device == torch.device("cpu")
        saver.finish_saves(KVStoreConnectorMetadata(saves=[BlockTransfer("r", keys, [4, 1, 2])]))
        assert (saver.stats.saved_blocks, saver.stats.refused_blocks) == (2, 1)
        assert node.match_prefix(keys) == 2
        stored = [np.empty(layout.block_bytes(), dtype=np.uint8) for _ in range(2)]
        assert node.batch_get_into(keys[:2], stored, namespace=ns) == [True, True]
        want = get_codec("int8").encode(blocks[:2])
        assert [s.tobytes() for s in stored] == [bytes(want[i].numpy().data) for i in range(2)]

        dst, _ = empty_pages(layout, 6)
        loader = WorkerSide(config, ns, gs, ConnectorStats(), load_enabled=True, save_enabled=True)
        loader.register(dict(zip(names, dst, strict=True)), names, paged.page)
        loader.start_loads(KVStoreConnectorMetadata(loads=[BlockTransfer("r", keys, [0, 3, 5])]))
        assert loader.load_errors() == {5}
        got = PagedKV(dst, layout, paged.page).gather([0, 3])
        assert torch.equal(got, get_codec("int8").decode(want, torch.empty_like(blocks[:2])))
