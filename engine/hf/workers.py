"""Disaggregated prefill and decode workers that share KV only through the store.

The prefill worker matches the prompt's longest stored prefix, loads it, computes
the rest, writes the new full blocks and hands the request off (prompt + first
token). The decode worker, typically another process on another host, fetches the
prompt's KV from the store and streams greedy tokens. Neither worker sees the
other's tensors.

The handoff is lossless: the decode worker continues from exactly the KV the
prefill worker holds, bit for bit, so its tokens equal the prefill worker's own
continuation in any dtype. Recomputing the partial tail on the decode side is not
enough: in bf16 a forward over the tail against a cached prefix rounds differently
from the prefill's pass (4 of 8 SmolLM2 chat prompts diverged). So the prefill
worker also writes request-scoped blocks for every prompt token whose KV the shared
prefix blocks do not already hold as it computed them: the partial tail (zero-padded
to a block), and a full block whose stored copy came from another computation (a
block already present, recomputed because at least the last prompt token always
is). Those keys are random per request, never prefix keys, so no other request
matches them; the serving layer removes them after the decode loaded them.

When the request-scoped blocks cannot be read (a store node down), the decode worker
falls back to what the store has and recomputes the rest: a miss and a recompute,
exact in fp32, and counted (``tail_recomputed``).

Both workers run on whatever device the model is on: every id tensor is made there
(:meth:`HFKVAdapter.input_ids`), a prefill's new blocks and its request-scoped blocks
each go to the store as one staged batch, and a decode worker's blocks land as one
batch in one device tensor (engine/hf/adapter.py). The handoff is exact on a GPU for
the same reason as on a CPU: the decode worker continues from the very bytes the
prefill worker held.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.blockstore import BlockStore
from engine.hf.adapter import HFKVAdapter, model_device
from engine.hf.blockio import matched_blocks
from engine.hf.layerwise import decoder_layers, forward_loading
from kvstore.errors import KVStoreError

__all__ = [
    "DecodeWorker",
    "FetchStats",
    "Handoff",
    "PrefillStats",
    "PrefillWorker",
    "answer_blocks",
    "greedy_continue",
    "scoped_keys",
    "store_answer",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillStats:
    """Where a prefill's time went (wall and CPU seconds)."""

    prompt_tokens: int = 0
    cached_blocks: int = 0
    computed_tokens: int = 0
    stored_blocks: int = 0
    fetch_s: float = 0.0
    compute_s: float = 0.0
    store_s: float = 0.0
    ttft_s: float = 0.0
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FetchStats:
    """A decode worker's read of a handoff's KV: blocks and stored bytes that arrived,
    and the seconds from the first request to the KV cache rebuilt in the engine's
    dtype on its device (a compressed namespace's bytes are fewer, and decoded here)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class Handoff:
    """What a prefill worker passes to a decode worker: ids, not tensors."""

    request_id: str
    prompt: list[int]
    first_token: int
    stats: PrefillStats = field(default_factory=PrefillStats)
    shared_blocks: int = -1
    """Leading prompt blocks whose stored bytes are exactly this prefill's KV (-1: unknown)."""
    scoped: list[str] = field(default_factory=list)
    """Hex keys of the request-scoped blocks holding tokens ``shared_blocks * B`` onward."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for a queue or a pipe between processes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Handoff:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["request_id"],
            list(d["prompt"]),
            int(d["first_token"]),
            PrefillStats(**d.get("stats", {})),
            int(d.get("shared_blocks", -1)),
            [str(k) for k in d.get("scoped", [])],
        )

    def scoped_keys(self) -> list[bytes]:
        """The request-scoped block keys as bytes."""
        return [bytes.fromhex(k) for k in self.scoped]


def scoped_keys(request_id: str, n: int) -> list[bytes]:
    """``n`` fresh request-scoped block keys: random per call (a retried or repeated
    request id never finds an older request's blocks), domain-separated from prefix keys."""
    nonce = secrets.token_bytes(16)
    return [
        hashlib.blake2b(
            f"{request_id}/{i}".encode(), digest_size=16, key=nonce, person=b"kvstore/handoff"
        ).digest()
        for i in range(n)
    ]


def greedy_continue(
    model: Any, cache: Any, first: int, max_new_tokens: int, stop_ids: Collection[int] = ()
) -> Iterator[int]:
    """Greedy tokens from a cache that holds the whole prompt, ``first`` first.

    One forward per token (the generator advances only when asked, so a server can
    interleave requests between tokens). The prefill worker's own continuation and
    the decode worker run exactly this, which is what makes them agree bit for bit.
    """
    tok = first
    device = model_device(model)
    for i in range(max_new_tokens):
        yield tok
        if tok in stop_ids or i == max_new_tokens - 1:
            return
        with torch.inference_mode():
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)
            out = model(ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = int(out.logits[0, -1].argmax())


def answer_blocks(
    adapter: HFKVAdapter, prompt: Sequence[int], tokens: Sequence[int], cache: Any
) -> tuple[list[bytes], torch.Tensor] | None:
    """The full blocks of a generated answer that its cache holds, keyed by the chain of
    prompt and answer (what a chat's next turn, whose prompt repeats the answer, looks
    up): their keys and one staging tensor of them on the cache's device, or None when
    there is nothing to store.

    The last generated token was never fed back, so the cache holds the prompt and
    the answer but its last token; a cache of any other length (a stream cut short, a
    cache that is not this answer's) gives nothing, so no block's bytes can be
    another token's. The prompt's own full blocks were stored by its prefill."""
    ids = list(prompt) + list(tokens[:-1])
    if cache is None or not tokens or cache.get_seq_length() != len(ids):
        return None
    B = adapter.block_tokens
    start, stop = len(prompt) // B, len(ids) // B
    if stop <= start:
        return None
    return list(adapter.keys(ids)[start:stop]), adapter.gather(cache, start, stop)


def store_answer(
    adapter: HFKVAdapter,
    store: BlockStore,
    prompt: Sequence[int],
    tokens: Sequence[int],
    cache: Any,
) -> int:
    """Store :func:`answer_blocks` in ``store``; returns how many were newly stored."""
    got = answer_blocks(adapter, prompt, tokens, cache)
    if got is None:
        return 0
    return sum(r is True for r in adapter.put_blocks(store, *got))


def _layers_to_wait_in(adapter: HFKVAdapter) -> list[torch.nn.Module] | None:
    """The decoder layers a prefix loading beside the forward waits in, None when it
    cannot: the store has layer ranges of uncompressed blocks only, and the model
    must have a list of decoder layers."""
    if adapter.codec is not None:
        return None
    return decoder_layers(adapter.model, adapter.layout.layers)


def _as_ids(prompt: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


class PrefillWorker:
    """Computes prompts, reusing and extending the store's prefix cache.

    ``layer_parts``: load the stored prefix in that many parts of the model's depth
    beside the forward (engine/hf/layerwise.py), so the fetch hides behind the compute;
    0 fetches it whole first, and so does a compressed namespace (the store has no
    layer ranges of its blocks). Worth it against a store that reads layer ranges (a
    StoreClient); an in-process NodeStore reads whole blocks for each range."""

    def __init__(self, adapter: HFKVAdapter, store: BlockStore, *, layer_parts: int = 0) -> None:
        self.adapter = adapter
        self.store = store
        self._layers = _layers_to_wait_in(adapter) if layer_parts else None
        self.layer_parts = layer_parts if self._layers is not None else 0
        self.store_errors = 0  # store calls that failed (each one a miss, not a failure)
        self.layerwise_misses = 0  # layer-wise loads a missing part turned into a recompute

    def prefill(self, request_id: str, prompt: Sequence[int] | torch.Tensor) -> Handoff:
        """Run one prompt; returns the handoff carrying the first generated token."""
        return self.prefill_with_cache(request_id, prompt)[0]

    @torch.inference_mode()
    def prefill_with_cache(
        self, request_id: str, prompt: Sequence[int] | torch.Tensor, *, handoff: bool = True
    ) -> tuple[Handoff, Any]:
        """Run one prompt; returns the handoff and this worker's own cache of it.

        ``handoff=False`` skips the request-scoped blocks (the caller decodes here).
        """
        ids = _as_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        ad = self.adapter
        st = PrefillStats(prompt_tokens=len(ids))
        t0, c0 = time.perf_counter(), time.process_time()
        keys = ad.keys(ids)
        n, out, fetch_s = self._compute(ids, keys)
        first = int(out.logits[0, -1].argmax())
        cache = out.past_key_values
        t2 = time.perf_counter()
        t1 = t0 + fetch_s
        st.ttft_s, st.cpu_s = t2 - t0, time.process_time() - c0
        start = n * ad.block_tokens
        shared, st.stored_blocks = self._store_new(keys, cache, n)
        st.cached_blocks, st.computed_tokens = n, len(ids) - start
        h = Handoff(request_id, ids, first, st, shared_blocks=shared)
        if handoff and shared * ad.block_tokens < len(ids):
            h.scoped = self._put_scoped(request_id, cache, shared * ad.block_tokens, len(ids))
            if not h.scoped:
                h.shared_blocks = -1  # nothing exact to hand over: the decode side recomputes
        st.fetch_s, st.compute_s, st.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return h, cache

    def _compute(self, ids: list[int], keys: Sequence[bytes]) -> tuple[int, Any, float]:
        """Load the stored prefix and compute the rest: (blocks loaded, the forward's
        output, seconds spent fetching before the forward could start). Only the last
        position's logits are computed (generate() asks for the same)."""
        ad = self.adapter
        t0 = time.perf_counter()
        try:
            if self._layers is not None:
                n = ad.reusable_blocks(len(ids), matched_blocks(self.store, keys))
                rest = ids[n * ad.block_tokens :]
                out, load = forward_loading(
                    ad, self.store, keys[:n], rest, self._layers, self.layer_parts
                )
                if out is not None:  # the fetch ran beside the forward
                    return n, out, 0.0
                if load is not None and load.error is not None:
                    self._failed("load prefix layer by layer", load.error)
                self.layerwise_misses += load is not None
                n, cache = 0, None  # a part missed: the prompt is computed whole
            else:
                n, cache = ad.load_prefix(self.store, keys, len(ids))
        except KVStoreError as exc:  # the store is down: a miss
            self._failed("load prefix", exc)
            n, cache = 0, None
        fetch_s = time.perf_counter() - t0
        out = ad.model(
            ad.input_ids(ids[n * ad.block_tokens :]),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return n, out, fetch_s

    def _store_new(self, keys: Sequence[bytes], cache: Any, n: int) -> tuple[int, int]:
        """Write full blocks ``n..`` from ``cache`` as one staged batch; returns (leading
        blocks whose stored bytes are this cache's, blocks newly written)."""
        if n >= len(keys):
            return n, 0
        ad = self.adapter
        res = ad.put_blocks(self.store, keys[n:], ad.gather(cache, n, len(keys)))
        shared, new, exact = n, 0, True
        for j, r in enumerate(res, n):
            if isinstance(r, Exception):
                self._failed("put", r)
                break
            new += r is True
            exact = exact and r is True  # False: another computation's copy is stored
            if exact:
                shared = j + 1
        return shared, new

    def _put_scoped(self, request_id: str, cache: Any, start: int, stop: int) -> list[str]:
        """Write tokens ``start..stop-1`` as request-scoped blocks, one staged batch;
        [] if any write fails (then the ones written are removed, best effort)."""
        ad = self.adapter
        blocks = ad.gather_tokens(cache, start, stop)
        keys = scoped_keys(request_id, len(blocks))
        res = ad.put_blocks(self.store, keys, blocks)
        bad = next((r for r in res if r is not True), None)
        if bad is None:
            return [k.hex() for k in keys]
        if isinstance(bad, Exception):
            self._failed("put request-scoped blocks", bad)
        written = [k for k, r in zip(keys, res, strict=True) if r is True]
        if written:
            try:
                self.store.remove(written)
            except KVStoreError as exc:
                log.info("could not remove request-scoped blocks (%s)", exc)
        return []

    def _failed(self, what: str, exc: Exception) -> None:
        self.store_errors += 1
        log.warning("prefill: store %s failed (%s); continuing without it", what, exc)


class DecodeWorker:
    """Continues a handed-off request from KV fetched out of the store."""

    def __init__(self, adapter: HFKVAdapter, store: BlockStore) -> None:
        self.adapter = adapter
        self.store = store
        self.last_loaded_blocks = 0
        self.last_fetch = FetchStats()
        self.first_token_mismatches = 0
        self.tail_recomputed = 0  # handoffs whose exact KV could not be read
        self.last_cache: Any = None  # the latest decode's cache, grown as it generates

    def decode(
        self,
        handoff: Handoff,
        max_new_tokens: int,
        eos_token_id: int | Collection[int] | None = None,
    ) -> Iterator[int]:
        """Yield greedy tokens, the handoff's first token first."""
        if eos_token_id is None:
            stop: Collection[int] = ()
        elif isinstance(eos_token_id, int):
            stop = (eos_token_id,)
        else:
            stop = eos_token_id
        cache = self._exact_cache(handoff)
        if cache is None:
            self.tail_recomputed += handoff.shared_blocks >= 0
            cache = self._recomputed_cache(handoff)
        self.last_cache = cache  # transformers grows it in place: the answer's KV too
        return greedy_continue(self.adapter.model, cache, handoff.first_token, max_new_tokens, stop)

    def _exact_cache(self, handoff: Handoff) -> Any:
        """The prefill worker's cache rebuilt bit for bit, None if any block is missing."""
        ad, ids = self.adapter, handoff.prompt
        shared = handoff.shared_blocks
        if shared < 0 or (shared * ad.block_tokens < len(ids) and not handoff.scoped):
            return None
        keys = list(ad.keys(ids)[:shared]) + handoff.scoped_keys()
        t0 = time.perf_counter()
        got, cache = ad.load_cache(self.store, keys, tokens=len(ids))  # one batch
        if ad.device.type == "cuda":  # the copies are queued: the time is their end's
            torch.cuda.synchronize(ad.device)
        self.last_fetch = FetchStats(got, got * ad.stored_block_bytes, time.perf_counter() - t0)
        if got < len(keys):
            return None
        self.last_loaded_blocks = shared
        return cache

    @torch.inference_mode()
    def _recomputed_cache(self, handoff: Handoff) -> Any:
        """The stored prefix plus a forward over the rest (exact in fp32 only)."""
        ad, ids = self.adapter, handoff.prompt
        t0 = time.perf_counter()
        try:
            n, cache = ad.load_prefix(self.store, ad.keys(ids), len(ids))
        except KVStoreError as exc:
            log.warning("decode: store read failed (%s); recomputing the prompt", exc)
            n, cache = 0, None
        self.last_loaded_blocks = n
        self.last_fetch = FetchStats(n, n * ad.stored_block_bytes, time.perf_counter() - t0)
        start = n * ad.block_tokens
        out = ad.model(
            ad.input_ids(ids[start:]), past_key_values=cache, use_cache=True, logits_to_keep=1
        )  # only the last position's logits are used (generate() asks for the same)
        if int(out.logits[0, -1].argmax()) != handoff.first_token:
            # Same weights and same KV give the same token; a difference means the
            # loaded KV is not what prefill computed. Counted, and prefill's token wins.
            self.first_token_mismatches += 1
        return out.past_key_values
