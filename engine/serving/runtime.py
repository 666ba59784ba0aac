"""One worker's engine: a model on one thread serving prefill, decode and generate.

All model work runs on a single executor thread, one forward at a time, which is
what a CPU (or one accelerator) can do anyway. A prefill is one job; a decode is one
job per token, so concurrent decodes interleave token by token and a prefill waits
at most one decode step. The asyncio side (the HTTP app) only awaits these jobs.
Storing a finished answer's blocks (``save_decode``) is two jobs: gathering them on
the device, on the model thread, then writing them, on one of a few threads of their
own: a store node that is slow or hung holds only that answer's end (up to its
client's timeout), never the other streams' tokens. At most ``ANSWERS_QUEUED`` answers
wait for their write, each holding a staged copy of its blocks on the device; past
that an answer is not stored (a later miss, counted in ``answers_not_stored``).

Load is accounted here, where it happens, and reported through ``on_load`` (the
worker's etcd registration): prompt tokens waiting for or in prefill, requests
running, and KV tokens reserved by running decodes out of ``kv_capacity_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.blockstore import GuardedStore, NullStore
from engine.hf.adapter import HFKVAdapter, model_device
from engine.hf.workers import (
    DecodeWorker,
    Handoff,
    PrefillWorker,
    answer_blocks,
    greedy_continue,
)
from engine.planning.scheduler import PrefillModel, PrefillSample, fit_prefill_model
from engine.registry import WorkerLoad, codec_label
from engine.serving.loading import LoadedModel
from engine.serving.prompts import PromptEncoder
from engine.serving.stores import HandoffReader
from kvstore.copies.caller import with_caller
from kvstore.errors import KVStoreError

__all__ = ["ANSWERS_QUEUED", "ANSWER_WRITERS", "Faults", "WorkerEngine", "calibrate_prefill"]

ANSWER_WRITERS = 4  # answers whose blocks are written at once (save_decode)
ANSWERS_QUEUED = 16  # answers gathered and not yet written, past which one is not stored

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Faults:
    """Injected delays, for fault tests: a prefill that takes long enough to be
    killed mid-request, a decode slow enough to be killed mid-stream. Off by default."""

    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0


@dataclass(slots=True)
class _Load:
    queued_tokens: int = 0
    running: int = 0
    reserved_kv: int = 0
    done: int = 0


class WorkerEngine:
    """The model, its adapter, and the stores one worker uses.

    ``local`` is the guarded client of the store node beside the worker (prefills read
    their prefix there and write new blocks there); ``cluster`` a cluster-wide client
    for decode reads (nearest replica); ``source_client(node_id)`` the guarded client
    of another node, for reading a handoff the directory has not caught up with.
    ``save_decode``: once an answer is whole, its full blocks are stored too, in the
    node that holds its prompt's (the prefill worker's, a handoff's source), so a
    chat's next turn, placed there for its prefix, finds its whole history
    (engine/hf/workers.py ``store_answer``). ``layer_parts``: a prefill's stored prefix
    loads in that many parts beside its forward (engine/hf/layerwise.py).
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        local: GuardedStore | None,
        cluster: Any = None,
        source_client: Callable[[str], GuardedStore | None] = lambda _n: None,
        store_node: str = "",
        kv_capacity_tokens: int = 65536,
        block_tokens: int = 16,
        faults: Faults = Faults(),
        on_load: Callable[[WorkerLoad], None] | None = None,
        kv_codec: str | None = None,
        save_decode: bool = False,
        layer_parts: int = 0,
    ) -> None:
        self.lm = lm
        self.save_decode = save_decode
        self.layer_parts = layer_parts
        self.adapter = HFKVAdapter(
            lm.model, model_id=lm.name, block_tokens=block_tokens, kv_codec=kv_codec
        )
        self.local, self.cluster = local, cluster
        self.source_client = source_client
        self.store_node = store_node
        self.kv_capacity_tokens = kv_capacity_tokens
        self.faults = faults
        self.on_load = on_load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="model")
        self._writer = ThreadPoolExecutor(ANSWER_WRITERS, thread_name_prefix="answers")
        self._encoder: PromptEncoder | None = None
        self._load = _Load()
        self.counters: dict[str, int] = {
            "prefills": 0, "decodes": 0, "generates": 0, "tail_recomputed": 0,
            "handoff_from_cluster": 0, "handoff_from_source": 0, "answer_blocks": 0,
            "answers_not_stored": 0,
        }  # fmt: skip
        self._answers_queued = 0  # gathered answers waiting for their write
        self.last_prefill: dict[str, Any] = {}  # the latest prefill's PrefillStats
        self.last_decode: dict[str, Any] = {}  # the latest handoff read (FetchStats)

    @property
    def kv_codec(self) -> str:
        """How this worker's blocks are stored: ``none``, ``int8`` or ``fp8``."""
        return codec_label(self.adapter.layout.codec)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.adapter.layout.block_bytes() // self.adapter.block_tokens

    def load(self) -> WorkerLoad:
        ld = self._load
        free = max(self.kv_capacity_tokens - ld.reserved_kv, 0)
        return WorkerLoad(ld.queued_tokens, ld.running, free, self.kv_capacity_tokens, ld.done)

    def _changed(self) -> None:
        if self.on_load is not None:
            self.on_load(self.load())

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False, cancel_futures=True)

    # -- prompts ---------------------------------------------------------------------------

    async def full_prompt(self, head: Sequence[int], rest: str) -> list[int]:
        """The prompt's ids: the router's ``head``, then ``rest`` tokenized here with the
        same encoder the router uses (a router stops tokenizing a long new message at
        the first block no node holds; engine/serving/prompts.py)."""
        ids = list(head)
        if rest:
            if self._encoder is None:
                self._encoder = await asyncio.to_thread(PromptEncoder, self.lm.tokenizer)
            ids += await asyncio.to_thread(self._encoder.encode_text, rest)
        return ids

    def context_error(self, n_prompt: int, max_tokens: int, param: str) -> dict[str, Any] | None:
        """The OpenAI error object when prompt + answer exceed the model's context."""
        ctx = self.lm.max_context
        if n_prompt + max_tokens <= ctx:
            return None
        return {
            "message": f"This model's maximum context length is {ctx} tokens. However, you "
            f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the {param}, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "completion.",
            "type": "invalid_request_error",
            "param": param,
            "code": "context_length_exceeded",
        }

    # -- prefill ---------------------------------------------------------------------------

    def _prefiller(self) -> PrefillWorker:
        store = self.local if self.local is not None else NullStore(refuse=_NO_NODE)
        return PrefillWorker(self.adapter, store, layer_parts=self.layer_parts)

    async def prefill(self, request_id: str, prompt: Sequence[int]) -> dict[str, Any]:
        """Prefill for another worker to decode: the handoff as plain data."""
        h, _ = await self._prefill(request_id, prompt, handoff=True)
        self.counters["prefills"] += 1
        self.last_prefill = asdict(h.stats)
        return {"handoff": h.to_dict(), "source_node": self.store_node}

    async def _prefill(self, rid: str, prompt: Sequence[int], *, handoff: bool) -> Any:
        n = len(prompt)
        self._load.queued_tokens += n
        self._load.running += 1
        self._changed()
        try:
            if self.faults.prefill_delay_s:
                await asyncio.sleep(self.faults.prefill_delay_s)
            pw = self._prefiller()
            return await self._run(lambda: pw.prefill_with_cache(rid, prompt, handoff=handoff))
        finally:
            self._load.queued_tokens -= n
            self._load.running -= 1
            self._load.done += 1
            self._changed()

    # -- decode ----------------------------------------------------------------------------

    async def decode(
        self, handoff: dict[str, Any], source_node: str, max_tokens: int, stop_ids: Sequence[int]
    ) -> AsyncIterator[dict[str, Any]]:
        """Continue a handoff: yields ``{"token": id}`` per token after the first
        (the router already sent the first), then ``{"done": ...}``."""
        h = Handoff.from_dict(handoff)
        source = self.source_client(source_node) if source_node else None
        reader = HandoffReader(self.cluster, source)
        dw = DecodeWorker(self.adapter, reader)
        gen_box: list[Iterator[int]] = []

        def start() -> int:
            gen = dw.decode(h, max_tokens + 1, set(stop_ids))  # reads the KV
            f = dw.last_fetch
            self.last_decode = {"blocks": f.blocks, "bytes": f.bytes, "fetch_s": f.seconds}
            gen_box.append(gen)
            first = next(gen)
            if source is not None and h.scoped:  # short-lived: gone once loaded
                try:
                    source.remove(h.scoped_keys())
                except KVStoreError as exc:
                    log.info("could not remove request-scoped blocks (%s)", exc)
            return first

        self.counters["decodes"] += 1
        stream = self._stream(
            len(h.prompt) + max_tokens, start, gen_box, max_tokens, stop_ids, skip_first=True
        )

        def decoded() -> Any:  # none when its KV is not what the prefill computed
            return None if dw.first_token_mismatches else dw.last_cache

        # the router sent the first token; the stream starts after it
        answer = self._keeping(stream, h.prompt, [h.first_token], decoded, source or self.local)
        async for item in answer:
            yield item
        self.counters["tail_recomputed"] += dw.tail_recomputed
        self.counters["handoff_from_cluster"] += reader.from_cluster
        self.counters["handoff_from_source"] += reader.from_source

    async def generate(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int]
    ) -> AsyncIterator[dict[str, Any]]:
        """Prefill and decode here (short prompts): ``{"prefill": ...}``, then every
        token, then ``{"done": ...}``."""
        h, cache = await self._prefill(request_id, prompt, handoff=False)
        self.counters["generates"] += 1
        yield {
            "prefill": {
                "cached_tokens": h.stats.cached_blocks * self.adapter.block_tokens,
                "prefill_s": h.stats.ttft_s,
                "shared_blocks": h.shared_blocks,
                "prompt_tokens": len(prompt),
                "prompt_ids": list(prompt),  # a router moving a cut stream needs them
            }
        }
        gen_box = [greedy_continue(self.lm.model, cache, h.first_token, max_tokens, set(stop_ids))]
        stream = self._stream(
            len(prompt) + max_tokens,
            lambda: next(gen_box[0]),
            gen_box,
            max_tokens,
            stop_ids,
            skip_first=False,
        )
        async for item in self._keeping(stream, prompt, [], lambda: cache, self.local):
            yield item

    async def _keeping(
        self,
        stream: AsyncIterator[dict[str, Any]],
        prompt: Sequence[int],
        tokens: list[int],
        cache: Callable[[], Any],
        store: GuardedStore | None,
    ) -> AsyncIterator[dict[str, Any]]:
        """``stream``'s items; with ``save_decode``, the whole answer (``tokens`` so far,
        then the stream's) has its full blocks stored in ``store`` after its last token
        went out and before its end does (the client's next turn cannot come sooner).
        ``cache()``: the answer's cache, None when it must not be stored."""
        async for item in stream:
            if "token" in item:
                tokens.append(item["token"])
            elif item.get("done") and self.save_decode:
                await self._keep_answer(prompt, tokens, cache(), store)
            yield item

    async def _keep_answer(
        self, prompt: Sequence[int], tokens: list[int], cache: Any, store: GuardedStore | None
    ) -> None:
        """Store a whole answer's full blocks in ``store``: gathered on the model thread,
        written on the answers thread (under the model thread's stream, so the write
        copies after the gather). A failed write is a later miss, never this answer's
        error."""
        if store is None or cache is None:
            return
        if self._answers_queued >= ANSWERS_QUEUED:  # the node is slow: keep no more copies
            self.counters["answers_not_stored"] += 1
            return
        ad = self.adapter

        def gather() -> Callable[[], list[Any]] | None:
            got = answer_blocks(ad, prompt, tokens, cache)
            return None if got is None else with_caller(lambda: ad.put_blocks(store, *got))

        self._answers_queued += 1  # the event loop's count: no lock
        try:
            write = await self._run(gather)
            if write is None:
                return
            loop = asyncio.get_running_loop()
            res = await loop.run_in_executor(self._writer, write)
        except Exception as exc:  # best effort: the answer is whole, whatever happens here
            log.warning("could not store an answer's blocks (%s: %s)", type(exc).__name__, exc)
            return
        finally:
            self._answers_queued -= 1
        self.counters["answer_blocks"] += sum(r is True for r in res)

    async def _stream(
        self,
        reserve: int,
        start: Callable[[], int],
        gen_box: list[Iterator[int]],
        max_tokens: int,
        stop_ids: Sequence[int],
        *,
        skip_first: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """Run a token generator one step per executor job, accounting its KV."""
        self._load.running += 1
        self._load.reserved_kv += reserve
        self._changed()
        stop = set(stop_ids)
        n, reason = 0, "length"
        try:
            tok: int | None = await self._run(start)
            if skip_first:
                n = 1
                if tok in stop:
                    yield {"done": True, "finish_reason": "stop", "completion_tokens": n}
                    return
                tok = await self._run(lambda: next(gen_box[0], None))
            while tok is not None and n < max_tokens:
                n += 1
                yield {"token": tok}
                if tok in stop:
                    reason = "stop"
                    break
                if n >= max_tokens:
                    break
                if self.faults.token_delay_s:
                    await asyncio.sleep(self.faults.token_delay_s)
                tok = await self._run(lambda: next(gen_box[0], None))
            yield {"done": True, "finish_reason": reason, "completion_tokens": n}
        finally:
            self._load.running -= 1
            self._load.reserved_kv -= reserve
            self._changed()


_NO_NODE = "this worker has no store node"

CALIBRATION_POINTS: tuple[tuple[int, int], ...] = (
    (32, 0), (128, 0), (256, 0), (256, 128), (512, 0), (512, 384), (1024, 0), (1024, 768),
)  # fmt: skip


@torch.inference_mode()
def calibrate_prefill(
    model: Any,
    vocab: int,
    max_tokens: int,
    points: Sequence[tuple[int, int]] = CALIBRATION_POINTS,
    *,
    budget_s: float = 8.0,
    min_points: int = 4,
) -> PrefillModel:
    """Fit the scheduler's prefill time model on this worker's own model and device.

    Each point times a forward of ``P - C`` new tokens against ``C`` cached ones
    (median of 3, after one warm-up), the way a prefill with a cache hit runs.
    Points go from small to large; once ``min_points`` are in and ``budget_s`` is
    spent, the larger ones are skipped (SmolLM2 on 2 cores would spend half a minute
    on the 1024-token points; the tiny model measures them all in well under a second).
    """
    from transformers import DynamicCache

    device = model_device(model)
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same ids on any device
    samples: list[PrefillSample] = []
    start = time.perf_counter()
    model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=device), logits_to_keep=1)
    for p, c in points:
        if p > max_tokens:
            continue
        if len(samples) >= min_points and time.perf_counter() - start > budget_s:
            break
        ids = torch.randint(0, vocab, (1, p), generator=gen).to(device)
        times = []
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            if c:
                model(input_ids=ids[:, :c], past_key_values=cache, logits_to_keep=1)
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids[:, c:], past_key_values=cache, logits_to_keep=1)
            int(out.logits[0, -1].argmax())  # the first token is on the host: the work is done
            times.append(time.perf_counter() - t0)
        samples.append(PrefillSample(p, c, statistics.median(times)))
    return fit_prefill_model(samples, source="worker calibration at start")


def _sync(device: torch.device) -> None:
    """Wait for a device's queued work, so a timer starts when the device is idle."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
