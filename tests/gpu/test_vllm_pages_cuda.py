"""vLLM's GPU pages on ``cuda``: the connector's copies between them and the store.

The same code as tests/vllm/test_vllm_parts.py runs on host tensors, here with the
pages on the GPU in vLLM's token order (each token's key then value, what every CUDA
backend's ``reshape_and_cache_flash`` writes), contiguous and as vLLM's strided LBNHC
views: the probe on the device, gathers into pinned staging (the layer-wise saver's
without a host wait on the forward's thread), scatters from a loader thread that the
forward's stream then reads, and a step's saves and loads through a real StoreNode.
vLLM itself is not on the GPU host; its writer is the reference one of the CPU tests.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.blockstore import NodeStore
from engine.vllm.loads import BlockTransfer, StepLoad
from engine.vllm.page_order import probe_page_layout
from engine.vllm.paged import PagedKV
from engine.vllm.saves import StepSave
from kvstore import Namespace, StoreNode, prefix_keys
from kvstore.layout import KVLayout
from tests.vllm.test_vllm_parts import (
    Clock,
    flash_writer,
    fp8_pages,
    kernel_pages,
    quantizing,
    resilient,
)

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

CUDA = torch.device("cuda", 0)


def _on_gpu(layers: list[torch.Tensor], strided: bool) -> list[torch.Tensor]:
    """Copies of host layer tensors on the GPU, as vLLM lays them out."""
    out = []
    for t in layers:
        n, H, B, C = t.shape
        dev = (
            torch.empty(n, B, H, C, dtype=t.dtype, device=CUDA).transpose(1, 2)
            if strided
            else torch.empty(n, H, B, C, dtype=t.dtype, device=CUDA)
        )
        dev.copy_(t)
        out.append(dev)
    return out


@pytest.mark.parametrize("strided", [False, True])
def test_gpu_pages_come_back_canonical(strided: bool) -> None:
    layout = KVLayout.parse("bfloat16:L2:H4:D64:B16:R0")
    page = probe_page_layout(flash_writer, torch.bfloat16, layout, split="tokens", device=CUDA)
    assert page.name == "flash"
    blocks = torch.randn(4, *layout.block_shape()).to(torch.bfloat16)
    ids = [5, 6, 0, 3]
    want = _on_gpu(kernel_pages(flash_writer, blocks, 8, ids, "tokens"), strided)
    paged = PagedKV(want, layout, page)
    got = paged.gather(ids)
    assert got.is_pinned() and torch.equal(got, blocks)
    on_device = paged.gather(ids, on_device=True)
    assert on_device.device == CUDA and torch.equal(on_device.cpu(), blocks)
    staging = paged.save_staging(len(ids))
    for li in range(layout.layers):
        paged.gather_layer(ids, li, staging[li : li + 1].transpose(0, 1), blocking=False)
    paged.fence()()
    assert torch.equal(staging.transpose(0, 1), blocks)
    empty = _on_gpu([torch.zeros_like(t, device="cpu") for t in want], strided)
    side = torch.cuda.Stream(CUDA)

    def load() -> None:  # the layer-wise loader's thread, on a stream of its own
        with torch.cuda.stream(side):
            PagedKV(empty, layout, page).scatter(blocks, ids)

    worker = threading.Thread(target=load)
    worker.start()
    worker.join()
    assert all(torch.equal(a, b) for a, b in zip(empty, want, strict=True))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_gpu_pages_come_back_as_their_bytes(fp8: torch.dtype) -> None:
    """An fp8 cache on the GPU (uint8 pages, strided as vLLM hands them): probed by
    value on the device, gathered into pinned fp8 blocks (the bytes the kernel wrote,
    in canonical order) and scattered back, bytes only."""
    layout = KVLayout.parse(f"{str(fp8).removeprefix('torch.')}:L2:H4:D64:B16:R0")
    write = quantizing(flash_writer, fp8)
    page = probe_page_layout(write, torch.uint8, layout, split="tokens", device=CUDA,
                             fp8=fp8, source=torch.bfloat16)  # fmt: skip
    assert page.name == "flash"
    kv = (torch.randn(3, *layout.block_shape()) * 2).to(torch.bfloat16)
    ids = [4, 0, 2]
    host = fp8_pages(write, kv, 6, ids, "tokens")
    pages = _on_gpu(host, strided=True)
    got = PagedKV(pages, layout, page).gather(ids)
    assert got.dtype == fp8 and got.is_pinned()
    assert torch.equal(got.view(torch.uint8), kv.float().to(fp8).view(torch.uint8))
    empty = _on_gpu([torch.zeros_like(t) for t in host], strided=True)
    PagedKV(empty, layout, page).scatter(got, ids)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(empty, host, strict=True))


def test_a_steps_saves_and_loads_move_gpu_pages_through_a_store() -> None:
    """StepSave gathers each layer on the forward's thread (kernels and a copy queued,
    no host wait) and the saver sends it after the copy's event; StepLoad lands the
    blocks layer by layer into other GPU pages, each layer there once ``wait`` returns."""
    ns = Namespace("gpu-steps", "bfloat16:L3:H2:D64:B16:R0")
    layout = KVLayout.parse(ns.layout)
    page = probe_page_layout(flash_writer, torch.bfloat16, layout, split="tokens", device=CUDA)
    blocks = torch.randn(3, *layout.block_shape()).to(torch.bfloat16)
    keys = list(prefix_keys(range(3 * 16), 16, ns))
    src = PagedKV(_on_gpu(kernel_pages(flash_writer, blocks, 8, [5, 6, 0], "tokens"), True),
                  layout, page)  # fmt: skip
    saver, loader = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    with StoreNode(dram_bytes="8MiB") as node:
        rs = resilient(NodeStore(node, ns), Clock())
        try:
            with torch.inference_mode():
                step = StepSave([BlockTransfer("a", keys, [5, 6, 0])], rs, src, 2, saver)
                for li in range(layout.layers):
                    step.layer(li)
                assert step.finish(set()) == (3, 0, 0)
            H, B, D = layout.kv_heads, 16, layout.head_dim
            dst_pages = [torch.zeros(8, H, B, 2 * D, dtype=torch.bfloat16, device=CUDA)
                         for _ in range(layout.layers)]  # fmt: skip
            dst = PagedKV(dst_pages, layout, page)
            load = StepLoad([BlockTransfer("a", keys, [1, 2, 7])], rs, dst, 2, loader)
            for li in range(layout.layers):
                load.wait(li)
                assert torch.equal(dst.gather([1, 2, 7])[:, li], blocks[:, li])
            assert [good for _, good in load.outcome()] == [3]
        finally:
            saver.shutdown()
            loader.shutdown()
