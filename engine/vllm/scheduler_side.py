"""The scheduler side of the vLLM connector: what each step loads and saves.

It runs in vLLM's scheduler process and never touches a page. ``lookup`` asks the store
for a prompt's longest stored prefix (one ``match_prefix`` round trip), keeping at least
the last prompt token for vLLM to compute; ``after_alloc`` turns a hit into a load of
those blocks into the pages vLLM allocated; ``build_meta`` hands the step's loads and
the full prompt blocks finished in this step (saves) to the worker side
(engine/vllm/worker_side.py), which moves the bytes. After a failed load the blocks
vLLM recomputes are planned for saving again.

With ``save_decode`` the blocks of generated tokens are saved too, each once the step
that computes its last token runs and its token ids are known (an async scheduler
learns a sampled token a step late: such a block is saved a step later, from the pages
the running request still holds). Their keys continue the prompt's chain, so they are
exactly the keys of a later prompt that repeats the answer (a chat's next turn).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from engine.blockstore import GuardedStore
from engine.vllm.keys import chain_root
from engine.vllm.loads import BlockTransfer
from engine.vllm.store import ConnectorStats
from kvstore.keys import Namespace, prefix_keys

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnectorMetadata", "SchedulerSide", "require_recompute"]

# vLLM's logger tree: its level (VLLM_LOGGING_LEVEL) and format apply to our lines.
logger = logging.getLogger("vllm.kvstore")

# vLLM's null block (block_pool.py: "a placeholder block with block_id=0"): what a
# sliding-window model's request holds for the blocks its window has left. Nothing is
# loaded into it (it must stay zero) and nothing of it is saved (it is no one's KV).
NULL_PAGE = 0


def _plain(request: Any) -> bool:
    """Whether the request's token ids name its inputs (no images, no embeddings)."""
    return not request.mm_features and getattr(request, "prompt_embeds", None) is None


def _real(keys: Sequence[bytes], page_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
    """The (key, page) pairs whose page is a real block, not the null one."""
    pairs = [(k, p) for k, p in zip(keys, page_ids, strict=True) if p != NULL_PAGE]
    return [k for k, _ in pairs], [p for _, p in pairs]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to load before and save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    """Scheduler-side facts about one live request."""

    keys: list[bytes]  # keys of the prompt's full blocks (with save_decode, the answer's)
    request: Request | None = None  # the live request (save_decode: its tokens grow)
    root: bytes | None = None  # where its key chain starts (engine/vllm/keys.py)
    local_tokens: int = 0  # tokens vLLM had locally at the latest lookup
    stored: int = 0  # leading blocks the store held at the latest lookup
    planned: int = 0  # leading blocks stored or already handed to the worker for saving
    loaded: dict[int, int] = field(default_factory=dict)  # page id -> block index


class SchedulerSide:
    """Per-request state and the step plans built from it (one per scheduler)."""

    def __init__(
        self,
        namespace: Namespace,
        store: GuardedStore,
        stats: ConnectorStats,
        *,
        load_enabled: bool,
        save_enabled: bool,
        save_decode: bool = False,
    ) -> None:
        self.namespace = namespace
        self.save_decode = save_enabled and save_decode
        self.block_size = namespace.kv_layout.block_tokens or 0
        self.store, self.stats = store, stats
        self.load_enabled, self.save_enabled = load_enabled, save_enabled
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []

    def _state(self, request: Request) -> _RequestState:
        """The request's state, made at its first lookup (vLLM looks up every request
        before it first schedules it): its keys (engine/vllm/keys.py), or none for a
        multimodal or embedding prompt, whose KV its token ids do not name."""
        st = self._reqs.get(request.request_id)
        if st is None:
            keys: list[bytes] = []
            root: bytes | None = None
            plain = _plain(request)
            if plain:  # else no keys: placeholder ids do not name multimodal inputs
                lora = getattr(request, "lora_request", None)
                root = chain_root(
                    self.namespace, self.block_size,
                    lora=f"{lora.lora_name}@{lora.lora_path}" if lora is not None else None,
                    salt=getattr(request, "cache_salt", None),
                )  # fmt: skip
                ids = request.prompt_token_ids or []
                keys = list(prefix_keys(ids, self.block_size, self.namespace, parent=root))
            st = self._reqs[request.request_id] = _RequestState(keys=keys, root=root)
            if plain and self.save_decode:
                st.request = request
        return st

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the store can supply beyond vLLM's local prefix, as whole blocks.

        One ``match_prefix`` over the prompt's full blocks; a saving side asks too, so
        it never writes (nor even gathers) blocks the store already holds.
        """
        st = self._state(request)
        if not st.keys:
            return 0
        st.local_tokens = num_computed_tokens
        # Keep the last prompt token for vLLM: its logits give the first output token.
        usable = min(len(st.keys), (request.num_prompt_tokens - 1) // self.block_size)
        load = self.load_enabled and num_computed_tokens % self.block_size == 0
        if not self.save_enabled and (not load or usable * self.block_size <= num_computed_tokens):
            return 0
        self.stats.lookups += 1
        st.stored = self.store.lookup(st.keys)
        st.planned = max(st.planned, st.stored)
        if not load:
            return 0
        return max(0, min(st.stored, usable) * self.block_size - num_computed_tokens)

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the promised blocks into the pages just allocated."""
        if num_external_tokens <= 0:
            return
        st = self._reqs[request.request_id]
        page_ids = blocks.get_block_ids()[0]
        first = st.local_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        keys, pages = _real(st.keys[first:end], page_ids[first:end])  # a window's past: none
        if pages:
            self._pending_loads.append(BlockTransfer(request.request_id, keys, pages))
        # pages change on preemption
        st.loaded = {page_ids[i]: i for i in range(first, end) if page_ids[i] != NULL_PAGE}
        self.stats.hit_tokens += num_external_tokens

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        """This step's loads, and saves of the prompt blocks this step completes."""
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self.save_enabled:
            meta.saves = self._plan_saves(scheduler_output)
        return meta

    def _plan_saves(self, so: SchedulerOutput) -> list[BlockTransfer]:
        before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        block_state = so.kv_connector_block_state
        saves = []
        for req_id, n_new in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or block_state is None:
                continue
            computed = (before.get(req_id, 0) + n_new) // self.block_size
            if self.save_decode:
                self._extend_keys(st, computed)
            if st.planned >= len(st.keys):
                continue
            done = min(len(st.keys), computed)
            page_ids = block_state.get_block_ids(req_id)
            if done <= st.planned or not page_ids:
                continue
            keys, pages = _real(st.keys[st.planned : done], page_ids[0][st.planned : done])
            if pages:
                saves.append(BlockTransfer(req_id, keys, pages))
            st.planned = done
        return saves

    def _extend_keys(self, st: _RequestState, computed: int) -> None:
        """Keys for the request's blocks up to ``computed`` whose token ids are known,
        continuing the chain from its last key (the prompt's, then the answer's)."""
        if st.request is None or computed <= len(st.keys):
            return
        if not _plain(st.request):  # a streamed session that gained images since
            st.request = None
            return
        B = self.block_size
        tokens = st.request.all_token_ids
        upto = min(computed, len(tokens) // B)
        if upto <= len(st.keys):
            return
        parent = st.keys[-1] if st.keys else st.root  # a short prompt: its own root
        more = prefix_keys(tokens[len(st.keys) * B : upto * B], B, self.namespace, parent=parent)
        prompt_blocks = st.request.num_prompt_tokens // B
        self.stats.decode_blocks += upto - max(len(st.keys), prompt_blocks)
        st.keys.extend(more)

    def after_output(self, connector_output: KVConnectorOutput) -> None:
        """After a failed load, plan the save of the recomputed blocks again."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            failed = [i for page, i in st.loaded.items() if page in bad]
            if failed:
                st.planned = min(st.planned, min(failed))
                st.loaded = {p: i for p, i in st.loaded.items() if i < min(failed)}

    def finished(self, request: Request) -> None:
        """Forget a finished request."""
        self._reqs.pop(request.request_id, None)


def require_recompute(transfer_config: Any) -> None:
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
