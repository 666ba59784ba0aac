"""vLLM KV connector (``KVConnectorBase_V1``) backed by kvstore.

Enable it with::

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="engine.vllm.connector",
        kv_role="kv_both",                 # kv_producer: save only; kv_consumer: load only
        kv_connector_extra_config={"endpoint": "127.0.0.1:7400", "token": "..."},
    )                                      # + "kv_codec": "int8" to store compressed KV

Keys are kvstore's own chained prefix keys (``prefix_keys``) over the prompt's full
blocks, with vLLM's block size and the model's KV layout (dtype, attention layers, KV
heads per rank, head dim, block size, TP rank) in the namespace, so two engines share a
block exactly when model, layout, tenant and every token up to it agree. One stored
object holds one block of every layer in the canonical layout of DESIGN.md
(``[layers, 2, kv_heads, block_tokens, head_dim]``, token-major): the same bytes
engine/hf/adapter.py stores for the same model, whichever attention kernel arranged
vLLM's pages: a CPU one (vec, vec16, amx, ...) or a CUDA backend's token order. The
namespace carries no kernel: a block saved by an engine on an AMX machine, or on a GPU,
loads into one without AMX, or on a CPU. engine/vllm/paged.py converts, and learns each
kernel's page order at start by running the kernel on a probe page
(engine/vllm/page_order.py).

Split by role as vLLM's own offloading connector is: this module is the facade vLLM
loads (the class named in ``kv_connector``), holding the scheduler-side object that
decides what to load and save (engine/vllm/scheduler_side.py) in the scheduler process,
and the worker-side object that moves bytes (engine/vllm/worker_side.py) in each worker.
Both reach the store through the breaker of engine/blockstore.py.

Scheduler side: ``get_num_new_matched_tokens`` asks the store for its longest stored
prefix (one ``match_prefix`` round trip), keeping at least the last prompt token for
vLLM to compute; ``update_state_after_alloc`` turns a hit into a load of those blocks
into the pages vLLM allocated; ``build_connector_meta`` hands the step's loads and the
full prompt blocks finished in this step (saves) to the worker.

Worker side: ``start_load_kv`` starts the step's loads (every request's hits in one
batch per layer, engine/vllm/loads.py): layer by layer in the background with
``layerwise`` (the default), each attention layer's ``wait_for_layer_load`` waiting for
its own layer only, so the forward starts once layer 0 has landed; whole blocks before
the forward without it. Saves of the step's new full prompt blocks go layer by layer
with ``layerwise_save`` (the default, engine/vllm/saves.py): ``save_kv_layer`` hands each
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

Compression: ``"kv_codec": "int8"`` (or ``"fp8"``) stores each block as that codec's
bytes (a quarter of fp32's, half of bf16's; kvstore/codec/): encoded right after the
gather out of the pages and decoded right before the scatter into them, on the KV
tensors' device (engine/vllm/compress.py). The layout in the namespace ends in
``:C<codec>``, so engines of different codecs (or none) never read each other's blocks:
they miss. A codec moves whole blocks (the store has no layer ranges of compressed
bytes): ``layerwise`` and ``layerwise_save`` default to off with one, and asking for
them is refused at start; so are an unknown codec and a device the codec cannot run on.

An fp8 KV cache (vLLM's ``kv_cache_dtype`` fp8, fp8_e4m3, fp8_e5m2) is stored as its
fp8 bytes, canonical, under a ``float8_e4m3fn`` (or ``float8_e5m2``) layout; its page
order is probed by value (engine/vllm/page_order.py). Its scales must be 1 (the
namespace carries none; ``check_kv_scales``), and a codec on it is refused.

Pools: ``"register": true`` (with ``etcd``, ``cluster``, ``role``, ``url``,
``lease_ttl_s``) puts the server in etcd under a lease, with its URL, role, model,
store node and requests in flight, for ``kvstore vllm-router --etcd`` to follow; the
scheduler side holds the record (engine/vllm/membership.py).

Not handled: hybrid models (more than one KV cache group), MLA, platforms other than
CPU and CUDA (refused at start); multimodal and embedding prompts (neither looked up
nor saved: their placeholder ids do not name their inputs). Blocks of generated
tokens are saved only with ``"save_decode": true`` (engine/vllm/scheduler_side.py).
Tensor parallelism is untested: each rank stores its shard under its own ``R<rank>``, and the
scheduler matches rank 0's keys (a shard missing on another rank is a load error there).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine.blockstore import BlockStore, GuardedStore
from engine.vllm.membership import Membership
from engine.vllm.page_order import quantized_dtype
from engine.vllm.paged import PagedKV
from engine.vllm.scheduler_side import KVStoreConnectorMetadata, SchedulerSide, require_recompute
from engine.vllm.store import ConnectorConfig, ConnectorStats, open_client
from engine.vllm.worker_side import WorkerSide, check_kv_scales, page_layout_for
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
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

__all__ = ["KVStoreConnector", "namespace_for"]

# vLLM's logger tree: its level (VLLM_LOGGING_LEVEL) and format apply to our lines.
logger = logging.getLogger("vllm.kvstore")


def windowed(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the KV cache group keeps only a window of each request (sliding window,
    chunked local attention: vLLM puts its null block where the window has left).

    Such a request cannot take a load that fails: vLLM recomputes from the first block
    that failed, and the tokens there attend to blocks before it that it no longer
    has. A model mixing windowed and full layers is one full-attention group (vLLM
    turns its hybrid KV cache manager off for this connector), and loads."""
    from vllm.v1 import kv_cache_interface as kinds

    # (A full-attention spec may name a window too: it keeps every block all the same.)
    names = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec", "RSWASpec", "CircularBufferSpec")
    windowed_kinds = tuple(getattr(kinds, n) for n in names if hasattr(kinds, n))
    groups = kv_cache_config.kv_cache_groups
    return bool(groups) and isinstance(groups[0].kv_cache_spec, windowed_kinds)


def namespace_for(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    model_id: str,
    rank: int,
    codec: str = "",
) -> Namespace:
    """This engine's KV namespace: model, canonical layout, rank and codec, nothing about
    the machine, so every engine and adapter of the same model, geometry and codec shares
    it (the layout spelled as HFKVAdapter's ``layout_of`` spells it)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVStoreConnector supports one KV cache group, this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", spec.head_size)
    if head_v != spec.head_size or getattr(spec, "num_kv_heads", None) is None:
        raise ConfigError("KVStoreConnector needs standard attention (same K and V head size)")
    fp8 = quantized_dtype(vllm_config.cache_config.cache_dtype)
    if fp8 is not None and codec:
        raise ConfigError("kv_codec compresses the model's dtype; this KV cache is fp8 already")
    # An fp8 cache's blocks are its fp8 bytes (at a scale of 1: check_kv_scales), named
    # so in the layout: never mixed with another dtype's, or the other fp8 format's.
    dtype = str(fp8 or spec.dtype).removeprefix("torch.")
    layers = len(groups[0].layer_names)
    layout = f"{dtype}:L{layers}:H{spec.num_kv_heads}:D{spec.head_size}:B{spec.block_size}:R{rank}"
    if codec:  # compressed blocks get keys of their own: never mixed with raw ones
        layout = KVLayout.parse(layout).with_codec(codec).canonical()
    return Namespace(model=model_id or vllm_config.model_config.model, layout=layout)


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache (see the module docstring): vLLM's
    calls, handed to the side of this role."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        load, save = bool(tc.is_kv_consumer), bool(tc.is_kv_producer)
        if load and windowed(kv_cache_config):
            logger.warning(
                "KVStoreConnector: this model's attention is windowed (every layer): vLLM "
                "keeps no KV before a request's window, so a failed load could not be "
                "recomputed correctly; loads are off, saves stay on"
            )
            load = False
        rank = 0
        if role is KVConnectorRole.SCHEDULER:
            require_recompute(tc)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        # The scheduler matches rank 0's keys; with TP > 1 a missing shard of another
        # rank shows up as a load error on that rank, which vLLM recomputes.
        self.namespace = namespace_for(
            vllm_config, kv_cache_config, self.config.model_id, rank, self.config.kv_codec
        )
        self.stats = ConnectorStats()
        self.store = GuardedStore(
            self._open_store, retry_after_s=self.config.retry_after_s, stats=self.stats,
            logger=logger,
        )  # fmt: skip
        self.store.open()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._members: Membership | None = None  # "register": this server in etcd
        if role is KVConnectorRole.SCHEDULER and self.config.register:
            self._members = Membership.join(self.config, vllm_config, self.namespace)
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.namespace, self.store, self.stats, load_enabled=load, save_enabled=save,
                save_decode=self.config.save_decode,
            )  # fmt: skip
        else:
            self._worker = WorkerSide(
                self.config, self.namespace, self.store, self.stats,
                load_enabled=load, save_enabled=save,
            )  # fmt: skip
        logger.info(
            "KVStoreConnector (%s) for %s %s at %s: load=%s save=%s",
            role.name.lower(), self.namespace.model, self.namespace.layout,
            self.config.endpoint, load, save,
        )  # fmt: skip

    def _open_store(self) -> BlockStore:
        """A new client of the configured store (a seam for fault-injecting subclasses)."""
        return open_client(self.config, self.namespace)

    @property
    def paged(self) -> PagedKV | None:
        """The worker side's view of vLLM's pages (None on the scheduler, or before
        ``register_kv_caches``)."""
        return None if self._worker is None else self._worker.paged

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the store can supply beyond vLLM's local prefix; loads are synchronous
        from the scheduler's view (never async)."""
        return self._sched().matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the promised blocks into the pages just allocated."""
        self._sched().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and saves of the prompt blocks this step completes."""
        return self._sched().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """After a failed load, plan the save of the recomputed blocks again."""
        self._sched().after_output(connector_output)

    def on_new_request(self, request: Request) -> None:
        """The scheduler took a request: one more in flight in this server's record."""
        if self._members is not None:
            self._members.request_added(request.request_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so vLLM may free the blocks at once."""
        self._sched().finished(request)
        if self._members is not None:
            self._members.request_finished(request.request_id)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind vLLM's paged tensors, in the layer order the namespace counts."""
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        check_kv_scales(self._vllm_config, names)
        page = page_layout_for(self._vllm_config, self._kv_cache_config)
        self._work().register(kv_caches, names, page)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads (engine/vllm/worker_side.py)."""
        self._work().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer of every block the step loads is in its pages."""
        self._work().wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """This layer of the step's new blocks is in its pages (engine/vllm/saves.py)."""
        self._work().save_layer(layer_name, self._meta)

    def wait_for_save(self) -> None:
        """Finish the step's saves, so vLLM may free a finished request's pages."""
        self._work().finish_saves(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pages promised by the scheduler that were not filled; vLLM recomputes them."""
        return self._work().load_errors()

    def shutdown(self) -> None:
        """Leave the pool (the server's record goes at once), close the store client;
        log what this side did."""
        if self._members is not None:
            self._members.stop()
        if self._worker is not None:
            self._worker.shutdown()
        logger.info("KVStoreConnector (%s) stats: %s", self.role.name.lower(),
                    self.stats.as_dict())  # fmt: skip
        self.store.close()
