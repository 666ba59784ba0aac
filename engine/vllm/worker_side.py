"""The worker side of the vLLM connector: moves the bytes the scheduler side planned.

It runs in each vLLM worker, beside the forward, and decides nothing: it binds vLLM's
paged KV tensors (learning the attention kernel's page order by running the kernel on
a probe page, engine/vllm/page_order.py), starts the step's loads (every request's hits in
one batch per layer, engine/vllm/loads.py): layer by layer in the background with
``layerwise`` (the default), each attention layer waiting for its own layer only, so
the forward starts once layer 0 has landed; whole blocks before the forward without
it. Saves of the step's new full prompt blocks go layer by layer with
``layerwise_save`` (the default, engine/vllm/saves.py), each layer handed to a
background saver as soon as attention has written it and committed in
``wait_for_save``; without it ``wait_for_save`` gathers and puts whole blocks. Either
way the saves are done when ``wait_for_save`` returns, so vLLM may free a finished
request's pages at once. With ``kv_codec`` the blocks are encoded after the gather and
decoded before the scatter, on the KV tensors' device (engine/vllm/compress.py), and
move whole. A block that fails to load is reported as a load error, for
vLLM to recompute; corrupt blocks are removed from the store.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.blockstore import GuardedStore
from engine.vllm.compress import BlockCodec
from engine.vllm.cpus import pin_this_thread, transfer_cpus
from engine.vllm.loads import BlockTransfer, StepLoad
from engine.vllm.page_order import PageWriter, quantized_dtype
from engine.vllm.paged import PagedKV, PageLayout, probe_page_layout
from engine.vllm.saves import StepSave
from engine.vllm.scheduler_side import KVStoreConnectorMetadata
from engine.vllm.store import ConnectorConfig, ConnectorStats
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide", "check_kv_scales", "cpu_attention_isa", "page_layout_for"]

# vLLM's logger tree: its level (VLLM_LOGGING_LEVEL) and format apply to our lines.
logger = logging.getLogger("vllm.kvstore")


def cpu_attention_isa(vllm_config: VllmConfig, spec: Any) -> str:
    """The ISA of vLLM's CPU attention kernel for this KV spec (vec, vec16, amx, neon,
    ...): it fixes how a page's bytes are arranged, never what the store holds."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # The backend asks with the model's dtype (a quantized cache's spec says uint8).
    model_dtype = vllm_config.model_config.dtype
    cache_dtype = vllm_config.cache_config.cache_dtype
    return str(_get_attn_isa(model_dtype, spec.block_size, spec.head_size, cache_dtype))


def page_layout_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PageLayout:
    """The page order of the kernel this engine runs, probed with the kernel's own
    reshape_and_cache (see engine/vllm/page_order.py): the CPU backend's, or on a CUDA
    GPU the one every CUDA backend (FlashAttention, Triton, FlashInfer, Flex) writes
    with, ``reshape_and_cache_flash``, on the engine's device."""
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = KVLayout.parse(f"{dtype}:L1:H1:D{spec.head_size}:B{spec.block_size}")
    cache = vllm_config.cache_config.cache_dtype
    if current_platform.is_cpu():
        kernel, split, device, write = _cpu_writer(vllm_config, spec)
    elif current_platform.is_cuda():
        kernel, split, device, write = _cuda_writer(cache)
    else:
        raise ConfigError("KVStoreConnector supports vLLM on CPU and on CUDA GPUs")
    fp8, source = quantized_dtype(cache), vllm_config.model_config.dtype
    try:
        page = probe_page_layout(
            write, spec.dtype, layout, split=split, device=device, fp8=fp8, source=source
        )
    except ConfigError:
        raise
    except Exception as exc:  # the kernel refused the probe itself
        raise ConfigError(f"probing vLLM's {kernel} page layout failed: {exc}") from exc
    return dataclasses.replace(page, name=f"{kernel}:{page.name}")


def _cpu_writer(vllm_config: VllmConfig, spec: Any) -> tuple[str, str, str, PageWriter]:
    from vllm import _custom_ops as ops

    isa = cpu_attention_isa(vllm_config, spec)
    cache = vllm_config.cache_config.cache_dtype

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        # A scale of 1, as every engine the connector serves runs (check_kv_scales).
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, cache
        )

    return isa, "regions", "cpu", write


def _cuda_writer(cache: str) -> tuple[str, str, str, PageWriter]:
    import torch
    from vllm import _custom_ops as ops

    device = f"cuda:{torch.cuda.current_device()}"

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        one = torch.ones((), dtype=torch.float32, device=key.device)  # fp8's scale: 1
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, cache, one, one)

    return "cuda", "tokens", device, write


def check_kv_scales(vllm_config: VllmConfig, layer_names: list[str]) -> None:
    """Refuse a quantized KV cache whose scales are not 1: fp8 bytes mean the value
    times their layer's scale, which the namespace does not carry (the scheduler side
    names blocks before any weights load), so engines with other scales would read each
    other's blocks as other values. vLLM's scales are 1 unless the checkpoint gives
    some or ``calculate_kv_scales`` computes them."""
    if vllm_config.cache_config.cache_dtype == "auto":
        return
    if getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        raise ConfigError("KVStoreConnector: calculate_kv_scales changes fp8 KV per run")
    layers = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        layer = layers.get(name)
        scales = [getattr(layer, a, None) for a in ("_k_scale_float", "_v_scale_float")]
        if scales != [1.0, 1.0]:  # a layer or scale it cannot read is refused too
            shown = scales if None not in scales else "unknown"
            raise ConfigError(
                f"KVStoreConnector stores fp8 KV at a scale of 1; layer {name} has "
                f"k/v scales {shown}"
            )


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class WorkerSide:
    """vLLM's pages, the load and save threads, and the step in flight (one per worker)."""

    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        store: GuardedStore,
        stats: ConnectorStats,
        *,
        load_enabled: bool,
        save_enabled: bool,
    ) -> None:
        self.config, self.namespace = config, namespace
        self.store, self.stats = store, stats
        self.load_enabled, self.save_enabled = load_enabled, save_enabled
        self.paged: PagedKV | None = None
        self.codec: BlockCodec | None = None  # with kv_codec, bound to the pages' device
        self._layer_of: dict[str, int] = {}  # attention layer name -> layer index
        self._step: StepLoad | None = None  # this step's loads, until settled
        self._loader: ThreadPoolExecutor | None = None  # the layer-wise load thread
        self._saver: ThreadPoolExecutor | None = None  # the layer-wise save thread
        self._save: StepSave | None = None  # this step's layer-wise saves, until committed
        self._save_checked = False  # this step's saves looked at (by the first layer)
        self._transfer_cpus: set[int] | None = None  # the load/save threads' own cores
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()

    def _pages(self) -> PagedKV:
        assert self.paged is not None, "register_kv_caches was not called"
        return self.paged

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_names: list[str],
        page: PageLayout,
    ) -> None:
        """Bind vLLM's paged tensors, in the layer order the namespace counts."""
        self.paged = PagedKV([kv_caches[n] for n in layer_names], self.namespace.kv_layout, page)
        self.paged.reserve(self.config.max_blocks_per_call)
        if self.config.kv_codec:  # probed on the pages' device: ConfigError stops the start
            p = self.paged
            self.codec = BlockCodec(self.config.kv_codec, p.layout, p.dtype, p.device)
            self.codec.reserve(self.config.max_blocks_per_call)
            logger.info("KVStoreConnector: kv_codec %s on %s, %d bytes a block (raw %d)",
                        self.codec.name, p.device, self.codec.stored_nbytes,
                        p.layout.raw_block_bytes())  # fmt: skip
        self._layer_of = {n: i for i, n in enumerate(layer_names)}
        cpus = self._transfer_cpus = transfer_cpus(self.config.transfer_cpus)
        if self.config.layerwise and self.load_enabled:
            self._loader = ThreadPoolExecutor(1, "kvstore-load", pin_this_thread, (cpus,))
        if self.config.layerwise_save and self.save_enabled:
            self._saver = ThreadPoolExecutor(1, "kvstore-save", pin_this_thread, (cpus,))
        if cpus is not None and (self._loader or self._saver):
            logger.info("KVStoreConnector: transfer threads on cores %s", sorted(cpus))
        logger.info("KVStoreConnector: pages in the %s order, stored canonical (%s path)",
                    page.name, "structured" if page.structured else "indexed")  # fmt: skip

    # -- loads ----------------------------------------------------------------------------

    def start_loads(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads: layer by layer beside the forward, or (without
        ``layerwise``) whole blocks, done when this returns."""
        self.settle()  # an earlier step's, if the engine never asked (profiling runs)
        if not meta.loads:
            return
        chunk = self.config.max_blocks_per_call
        self._step = StepLoad(
            meta.loads, self.store, self._pages(), chunk, self._loader, codec=self.codec
        )
        if self._loader is not None:
            self.stats.layerwise_loads += 1

    def settle(self) -> None:
        """Wait for the step's loads to end and record what failed: vLLM recomputes a
        request from its first block that did not load."""
        step, self._step = self._step, None
        if step is None:
            return
        for item, good in step.outcome():
            self.stats.loaded_blocks += good
            if good < len(item.keys):
                failed = item.block_ids[good:]
                self._load_errors.update(failed)
                self._failed_reqs.add(item.req_id)
                self.stats.failed_blocks += len(failed)
        bad = step.failed_keys()
        if bad and self.store.available:  # the store answered: these keys are bad or gone
            self.store.discard(bad)

    def wait_layer(self, layer_name: str) -> None:
        """Return once this layer of every block the step loads is in its pages."""
        step = self._step
        if step is not None:
            t0 = time.perf_counter()
            step.wait(self._layer_of[layer_name])
            self.stats.layer_wait_us += int((time.perf_counter() - t0) * 1e6)

    def load_errors(self) -> set[int]:
        """Pages promised by the scheduler that were not filled; vLLM recomputes them."""
        self.settle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: Callable[[], KVStoreConnectorMetadata]) -> None:
        """This layer of the step's new blocks is in its pages: with ``layerwise_save``,
        hand it to the background saver, which sends it while the forward computes the
        next layers. ``meta`` is read once a step, by the first layer."""
        if self._saver is None:
            return
        if not self._save_checked:
            self._save_checked = True
            saves = meta().saves
            if saves and self.store.available:
                self._save = StepSave(
                    saves,
                    self.store,
                    self._pages(),
                    self.config.max_blocks_per_call,
                    self._saver,
                    # A GPU's gathers are kernels queued on the forward's stream.
                    gather_in_saver=self._transfer_cpus is not None
                    and self._pages().device.type == "cpu",
                )
                self.stats.layerwise_saves += 1
        if self._save is not None:
            t0 = time.perf_counter()
            self._save.layer(self._layer_of[layer_name])
            self.stats.save_layer_us += int((time.perf_counter() - t0) * 1e6)

    def finish_saves(self, meta: KVStoreConnectorMetadata) -> None:
        """Finish the step's saves: commit the layer-by-layer ones, or write the
        completed prompt blocks whole (the scheduler left out those the store held at
        lookup; the store skips the copy of any other it already has)."""
        self.settle()
        # A request whose load failed this step attended to pages that were never
        # filled, so none of its new KV may be saved.
        failed, self._failed_reqs = self._failed_reqs, set()
        step, self._save, self._save_checked = self._save, None, False
        if step is not None:
            t0 = time.perf_counter()
            new, present, withdrawn = step.finish(failed)
            self.stats.save_wait_us += int((time.perf_counter() - t0) * 1e6)
            self.stats.saved_blocks += new
            self.stats.present_blocks += present
            self.stats.withdrawn_blocks += withdrawn
            return
        self._save_whole([t for t in meta.saves if t.req_id not in failed])

    def _save_whole(self, saves: list[BlockTransfer]) -> None:
        """Gather and put whole blocks, a chunk at a time, until the store goes down."""
        keys = [k for t in saves for k in t.keys]
        ids = [b for t in saves for b in t.block_ids]
        if not keys:
            return
        paged = self._pages()
        t0 = time.perf_counter()
        for part in _chunks(len(keys), self.config.max_blocks_per_call):
            if not self.store.available:
                break  # the store is down: these blocks stay unsaved
            blocks = paged.gather(ids[part], on_device=self.codec is not None)
            part_keys, values = keys[part], [blocks[j] for j in range(len(blocks))]
            if self.codec is not None:  # encoded where the pages are; refused ones skipped
                coded = self.codec.encode(blocks)
                part_keys = [k for k, v in zip(part_keys, coded, strict=True) if v is not None]
                values = [v for v in coded if v is not None]
                self.stats.refused_blocks += len(coded) - len(values)
            new, present = self.store.save(part_keys, values)
            self.stats.saved_blocks += new
            self.stats.present_blocks += present
        self.stats.save_wait_us += int((time.perf_counter() - t0) * 1e6)

    def shutdown(self) -> None:
        """Let the step in flight end and stop the transfer threads."""
        self.settle()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)
