"""vLLM KV connector (``KVConnectorBase_V1``) backed by kvstore.

Enable it with::

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="engine.vllm_connector",
        kv_role="kv_both",                 # kv_producer: save only; kv_consumer: load only
        kv_connector_extra_config={"endpoint": "127.0.0.1:7400", "token": "..."},
    )

Keys are kvstore's own chained prefix keys (``prefix_keys``) over the prompt's full
blocks, with vLLM's block size and the model's KV layout (dtype, attention layers, KV
heads per rank, head dim, block size, TP rank) in the namespace, so two engines share a
block exactly when model, layout, tenant and every token up to it agree. One stored
object holds one block of every layer in the canonical layout of DESIGN.md
(``[layers, 2, kv_heads, block_tokens, head_dim]``, token-major): the same bytes
engine/hf.py stores for the same model, whichever CPU attention kernel (vec, vec16,
amx, ...) arranged vLLM's pages. The namespace carries no kernel: a block saved by an
engine on an AMX machine loads into one without AMX. engine/vllm_paged.py converts, and
learns each kernel's page order at start by running the kernel on a probe page.

Scheduler side: ``get_num_new_matched_tokens`` asks the store for its longest stored
prefix (one ``match_prefix`` round trip), keeping at least the last prompt token for
vLLM to compute; ``update_state_after_alloc`` turns a hit into a load of those blocks
into the pages vLLM allocated; ``build_connector_meta`` hands the step's loads and the
full prompt blocks finished in this step (saves) to the worker.

Worker side: ``start_load_kv`` starts the step's loads (every request's hits in one
batch per layer, engine/vllm_loads.py): layer by layer in the background with
``layerwise`` (the default), each attention layer's ``wait_for_layer_load`` waiting for
its own layer only, so the forward starts once layer 0 has landed; whole blocks before
the forward without it. Saves of the step's new full prompt blocks go layer by layer
with ``layerwise_save`` (the default, engine/vllm_saves.py): ``save_kv_layer`` hands each
layer to a background saver as soon as attention has written it, and ``wait_for_save``
commits; without it ``wait_for_save`` gathers and puts whole blocks. Either way the
saves are done when ``wait_for_save`` returns, so vLLM may free a finished request's
pages at once, and the store skips blocks it already holds. A block
that fails to load (miss, corrupt, store down) is reported through
``get_block_ids_with_load_errors``; vLLM then recomputes from it, so the failure costs
time, never a request or a wrong token. That needs vLLM's
``kv_load_failure_policy="recompute"``, which this connector sets (with a warning) when
it finds vLLM's default ``"fail"``. Corrupt blocks are removed from the store, and the
scheduler plans their save again after vLLM recomputes them.

Not handled: hybrid models (more than one KV cache group), MLA, GPU page layouts
(refused at start), decode-phase blocks (only prompt blocks are saved). Tensor
parallelism is untested: each rank stores its shard under its own ``R<rank>``, and the
scheduler matches rank 0's keys (a shard missing on another rank is a load error there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine.vllm_cpus import pin_this_thread, transfer_cpus
from engine.vllm_loads import BlockTransfer, StepLoad
from engine.vllm_paged import PagedKV, PageLayout, probe_page_layout
from engine.vllm_saves import StepSave
from engine.vllm_store import (
    BlockStore,
    ConnectorConfig,
    ConnectorStats,
    ResilientStore,
    open_client,
)
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, prefix_keys
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "BlockTransfer",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "cpu_attention_isa",
    "namespace_for",
    "page_layout_for",
]

# vLLM's logger tree: its level (VLLM_LOGGING_LEVEL) and format apply to our lines.
logger = logging.getLogger("vllm.kvstore")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to load before and save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    """Scheduler-side facts about one live request."""

    keys: list[bytes]  # keys of the prompt's full blocks
    local_tokens: int = 0  # tokens vLLM had locally at the latest lookup
    stored: int = 0  # leading blocks the store held at the latest lookup
    planned: int = 0  # leading blocks stored or already handed to the worker for saving
    loaded: dict[int, int] = field(default_factory=dict)  # page id -> block index


def cpu_attention_isa(vllm_config: VllmConfig, spec: Any) -> str:
    """The ISA of vLLM's CPU attention kernel for this KV spec (vec, vec16, amx, neon,
    ...): it fixes how a page's bytes are arranged, never what the store holds."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ConfigError("KVStoreConnector supports vLLM's CPU attention backend only (for now)")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    return str(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype))


def namespace_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str, rank: int
) -> Namespace:
    """This engine's KV namespace: model, canonical layout and rank, nothing about the
    machine, so every engine and adapter of the same model and geometry shares it."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVStoreConnector supports one KV cache group, this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", spec.head_size)
    if head_v != spec.head_size or getattr(spec, "num_kv_heads", None) is None:
        raise ConfigError("KVStoreConnector needs standard attention (same K and V head size)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ConfigError(
            f"KVStoreConnector stores KV in the model's dtype; kv_cache_dtype={cache_dtype!r} "
            "(a quantized KV cache) is not supported yet"
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    layers = len(groups[0].layer_names)
    layout = f"{dtype}:L{layers}:H{spec.num_kv_heads}:D{spec.head_size}:B{spec.block_size}:R{rank}"
    return Namespace(model=model_id or vllm_config.model_config.model, layout=layout)


def page_layout_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PageLayout:
    """The page order of the kernel this engine runs, probed with the kernel's own
    reshape_and_cache (see engine/vllm_paged.py)."""
    from vllm import _custom_ops as ops

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    isa = cpu_attention_isa(vllm_config, spec)

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    dtype = str(spec.dtype).removeprefix("torch.")
    layout = KVLayout.parse(f"{dtype}:L1:H1:D{spec.head_size}:B{spec.block_size}")
    try:
        page = probe_page_layout(write, spec.dtype, layout)
    except ConfigError:
        raise
    except Exception as exc:  # the kernel refused the probe itself
        raise ConfigError(f"probing vLLM's {isa} page layout failed: {exc}") from exc
    return PageLayout(f"{isa}:{page.name}", page.index, page.key, page.value)


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        self.load_enabled = bool(tc.is_kv_consumer)
        self.save_enabled = bool(tc.is_kv_producer)
        rank = 0
        if role is KVConnectorRole.SCHEDULER:
            _require_recompute(tc)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        # The scheduler matches rank 0's keys; with TP > 1 a missing shard of another
        # rank shows up as a load error on that rank, which vLLM recomputes.
        self.namespace = namespace_for(vllm_config, kv_cache_config, self.config.model_id, rank)
        self.block_size = self.namespace.kv_layout.block_tokens or 0
        self.stats = ConnectorStats()
        self.store = ResilientStore(
            self._open_store,
            retry_after_s=self.config.retry_after_s,
            stats=self.stats,
        )
        self.store.open()
        # scheduler side
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        # worker side
        self._paged: PagedKV | None = None
        self._layer_of: dict[str, int] = {}  # attention layer name -> layer index
        self._step: StepLoad | None = None  # this step's loads, until settled
        self._loader: ThreadPoolExecutor | None = None  # the layer-wise load thread
        self._saver: ThreadPoolExecutor | None = None  # the layer-wise save thread
        self._save: StepSave | None = None  # this step's layer-wise saves, until committed
        self._save_checked = False  # this step's saves looked at (by the first layer)
        self._transfer_cpus: set[int] | None = None  # the load/save threads' own cores
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        logger.info(
            "KVStoreConnector (%s) for %s %s at %s: load=%s save=%s",
            role.name.lower(), self.namespace.model, self.namespace.layout,
            self.config.endpoint, self.load_enabled, self.save_enabled,
        )  # fmt: skip

    def _open_store(self) -> BlockStore:
        """A new client of the configured store (a seam for fault-injecting subclasses)."""
        return open_client(self.config, self.namespace)

    # -- scheduler side -------------------------------------------------------------------

    def _state(self, req_id: str, prompt: Sequence[int] | None) -> _RequestState | None:
        st = self._reqs.get(req_id)
        if st is None and prompt is not None:
            keys: list[bytes] = list(prefix_keys(prompt, self.block_size, self.namespace))
            st = self._reqs[req_id] = _RequestState(keys=keys)
        return st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the store can supply beyond vLLM's local prefix, as whole blocks.

        One ``match_prefix`` over the prompt's full blocks; a saving side asks too, so
        it never writes (nor even gathers) blocks the store already holds.
        """
        st = self._state(request.request_id, request.prompt_token_ids)
        if st is None or not st.keys:
            return 0, False
        st.local_tokens = num_computed_tokens
        # Keep the last prompt token for vLLM: its logits give the first output token.
        usable = min(len(st.keys), (request.num_prompt_tokens - 1) // self.block_size)
        load = self.load_enabled and num_computed_tokens % self.block_size == 0
        if not self.save_enabled and (not load or usable * self.block_size <= num_computed_tokens):
            return 0, False
        self.stats.lookups += 1
        st.stored = self.store.match_prefix(st.keys)
        st.planned = max(st.planned, st.stored)
        if not load:
            return 0, False
        return max(0, min(st.stored, usable) * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the promised blocks into the pages just allocated."""
        if num_external_tokens <= 0:
            return
        st = self._reqs[request.request_id]
        page_ids = blocks.get_block_ids()[0]
        first = st.local_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        self._pending_loads.append(
            BlockTransfer(request.request_id, st.keys[first:end], page_ids[first:end])
        )
        st.loaded = {page_ids[i]: i for i in range(first, end)}  # pages change on preemption
        self.stats.hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and saves of the prompt blocks this step completes."""
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self.save_enabled:
            meta.saves = self._plan_saves(scheduler_output)
        return meta

    def _plan_saves(self, so: SchedulerOutput) -> list[BlockTransfer]:
        before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self._state(new.req_id, new.prompt_token_ids)
            before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        block_state = so.kv_connector_block_state
        saves = []
        for req_id, n_new in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or block_state is None or st.planned >= len(st.keys):
                continue
            done = min(len(st.keys), (before.get(req_id, 0) + n_new) // self.block_size)
            page_ids = block_state.get_block_ids(req_id)
            if done <= st.planned or not page_ids:
                continue
            ids = page_ids[0]
            saves.append(BlockTransfer(req_id, st.keys[st.planned : done], ids[st.planned : done]))
            st.planned = done
        return saves

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """After a failed load, plan the save of the recomputed blocks again."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            failed = [i for page, i in st.loaded.items() if page in bad]
            if failed:
                st.planned = min(st.planned, min(failed))
                st.loaded = {p: i for p, i in st.loaded.items() if i < min(failed)}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so vLLM may free the blocks at once."""
        self._reqs.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind vLLM's paged tensors, in the layer order the namespace counts."""
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        page = page_layout_for(self._vllm_config, self._kv_cache_config)
        self._paged = PagedKV([kv_caches[n] for n in names], self.namespace.kv_layout, page)
        self._paged.reserve(self.config.max_blocks_per_call)
        self._layer_of = {n: i for i, n in enumerate(names)}
        cpus = self._transfer_cpus = transfer_cpus(self.config.transfer_cpus)
        if self.config.layerwise and self.load_enabled:
            self._loader = ThreadPoolExecutor(1, "kvstore-load", pin_this_thread, (cpus,))
        if self.config.layerwise_save and self.save_enabled:
            self._saver = ThreadPoolExecutor(1, "kvstore-save", pin_this_thread, (cpus,))
        if cpus is not None and (self._loader or self._saver):
            logger.info("KVStoreConnector: transfer threads on cores %s", sorted(cpus))
        logger.info("KVStoreConnector: pages in the %s order, stored canonical (%s path)",
                    page.name, "structured" if page.structured else "indexed")  # fmt: skip

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: layer by layer beside the forward, or (without
        ``layerwise``) whole blocks, done when this returns."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._settle()  # an earlier step's, if the engine never asked (profiling runs)
        if not meta.loads:
            return
        paged = self._paged
        assert paged is not None, "register_kv_caches was not called"
        chunk = self.config.max_blocks_per_call
        self._step = StepLoad(meta.loads, self.store, paged, chunk, self._loader)
        if self._loader is not None:
            self.stats.layerwise_loads += 1

    def _settle(self) -> None:
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
            self.store.remove(bad)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer of every block the step loads is in its pages."""
        step = self._step
        if step is not None:
            t0 = time.perf_counter()
            step.wait(self._layer_of[layer_name])
            self.stats.layer_wait_us += int((time.perf_counter() - t0) * 1e6)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """This layer of the step's new blocks is in its pages: with ``layerwise_save``,
        hand it to the background saver (engine/vllm_saves.py), which sends it while
        the forward computes the next layers."""
        if self._saver is None:
            return
        if not self._save_checked:
            self._save_checked = True
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStoreConnectorMetadata)
            if meta.saves and self.store.available:
                paged = self._paged
                assert paged is not None, "register_kv_caches was not called"
                chunk = self.config.max_blocks_per_call
                self._save = StepSave(
                    meta.saves,
                    self.store,
                    paged,
                    chunk,
                    self._saver,
                    gather_in_saver=self._transfer_cpus is not None,
                )
                self.stats.layerwise_saves += 1
        if self._save is not None:
            t0 = time.perf_counter()
            self._save.layer(self._layer_of[layer_name])
            self.stats.save_layer_us += int((time.perf_counter() - t0) * 1e6)

    def wait_for_save(self) -> None:
        """Finish the step's saves: commit the layer-by-layer ones, or write the
        completed prompt blocks whole (the scheduler left out those the store held at
        lookup; the store skips the copy of any other it already has)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._settle()
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
        saves = [t for t in meta.saves if t.req_id not in failed]
        keys = [k for t in saves for k in t.keys]
        ids = [b for t in saves for b in t.block_ids]
        if not keys:
            return
        paged = self._paged
        assert paged is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        for part in _chunks(len(keys), self.config.max_blocks_per_call):
            if not self.store.available:
                break  # the store is down: these blocks stay unsaved
            blocks = paged.gather(ids[part])
            new, present = self.store.put(keys[part], [blocks[j] for j in range(len(blocks))])
            self.stats.saved_blocks += new
            self.stats.present_blocks += present
        self.stats.save_wait_us += int((time.perf_counter() - t0) * 1e6)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pages promised by the scheduler that were not filled; vLLM recomputes them."""
        self._settle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the store client; log what this side did."""
        self._settle()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        logger.info("KVStoreConnector (%s) stats: %s", self.role.name.lower(),
                    self.stats.as_dict())  # fmt: skip
        self.store.close()


def _require_recompute(transfer_config: Any) -> None:
    """Make a failed load cost a recompute, not the request (vLLM's default fails it).

    The scheduler reads the policy right after creating its connector, so setting it
    here takes effect. An explicit ``"fail"`` cannot be told from the default, hence
    the warning.
    """
    if getattr(transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
        logger.warning(
            "KVStoreConnector: setting kv_load_failure_policy='recompute' (was %r) so that "
            "a store miss, corrupt block or outage recomputes instead of failing requests",
            transfer_config.kv_load_failure_policy,
        )
        transfer_config.kv_load_failure_policy = "recompute"
