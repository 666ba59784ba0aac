"""A prefill's stored prefix loaded part by part of the model's depth, beside its forward.

Why: a prefill whose prefix is in the store first fetched every block, then ran the
forward over the rest of the prompt, so its time to first token was the fetch plus the
compute. But decoder layer ``l`` needs only layer ``l``'s KV. So the layers are cut
into a few parts (:data:`LAYER_PARTS`), a loader thread fetches part 0 of every block
(one ``batch_get_into(..., layers=(a, b))`` per ``BATCH_KEYS`` blocks: kvstore's ranged
read, verified before it lands), writes it into the cache's tensors and marks it ready,
then part 1, and so on; a pre-hook on each decoder layer waits for its part alone.
The forward starts once part 0 has landed and the rest of the transfer runs behind
its compute, as SGLang's HiCache does with one CUDA event per layer and this project's
vLLM connector does per layer (engine/vllm/loads.py). Few parts, not one per layer:
each ranged read costs per key, and a 30-layer model's layer is a 30th of a block.

On a GPU the loader copies on a stream of its own and records an event per part; the
layer waits for it on the device (``wait_event``), not on the host, so compute queued
for earlier layers is never held up. The cache's tensors are allocated by the caller,
in its inference mode, and written by the loader, which enters inference mode too (as
torch requires of a thread that updates inference tensors in place).

A block that misses on any part (evicted since it was matched, a node gone) ends the
load: the waiting layer raises :class:`PartMissed` and the caller computes the whole
prompt instead, so a cache may miss but no layer ever reads KV that did not arrive.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.blockstore import BlockStore
from engine.hf.adapter import HFKVAdapter
from engine.hf.blockio import BATCH_KEYS, leading_hits
from kvstore.copies.caller import Caller, as_caller
from kvstore.errors import KVStoreError

__all__ = ["LAYER_PARTS", "LayerwiseLoad", "PartMissed", "decoder_layers", "forward_loading"]

log = logging.getLogger(__name__)

LAYER_PARTS = 4
"""How many parts of the model's depth a prefix is fetched in."""


class PartMissed(RuntimeError):
    """A part of the prefix did not arrive: the forward must not go on with it."""


def decoder_layers(model: Any, count: int) -> list[torch.nn.Module] | None:
    """The model's ``count`` decoder layers, in order: its decoder's ``layers``
    (``get_decoder()``), else the one ModuleList of ``count`` modules; None when neither
    is found or their attention layers say another order (the caller then loads whole
    blocks). :func:`forward_loading` checks besides that every layer's hook ran."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) < count:
        found = [
            m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count
        ]
        layers = found[0] if len(found) == 1 else None
    if layers is None:
        return None
    run = list(layers)[:count]  # a model may run fewer than it has
    for i, layer in enumerate(run):
        idx = getattr(getattr(layer, "self_attn", None), "layer_idx", i)
        if idx != i:
            return None
    return run


def _parts(layers: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous layer ranges covering ``layers``, as even as they come."""
    parts = max(1, min(parts, layers))
    bounds = [round(i * layers / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


_STREAMS: dict[int, Any] = {}  # device index -> the loaders' stream there
_STREAMS_LOCK = threading.Lock()


def _loader_stream(device: torch.device) -> Any:
    """The one stream layer-wise loads copy on, per device (a fresh pooled stream per
    load would leave each one's freed staging cached apart, and may share a stream
    with unrelated copies)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = torch.cuda.Stream(index)
        return stream


class LayerwiseLoad:
    """The blocks ``keys`` loaded part by part into :attr:`cache` (a DynamicCache of
    ``len(keys)`` full blocks) by a thread; :meth:`wait` before a layer reads them."""

    def __init__(
        self, adapter: HFKVAdapter, store: BlockStore, keys: Sequence[bytes], parts: int
    ) -> None:
        self.adapter, self.store, self.keys = adapter, store, list(keys)
        L, _, H, B, D = adapter.block_shape
        n, dev = len(self.keys), adapter.device
        kv = [torch.empty((2, 1, H, n * B, D), dtype=adapter.dtype, device=dev) for _ in range(L)]
        self.cache = adapter._cache([(x[0], x[1]) for x in kv])
        # the cache's own tensors (the adapter adopts these; a kind of layer it cannot
        # adopt holds copies), written in place as their part lands
        self._dst = [(ly.keys, ly.values) for ly in self.cache.layers]
        self.parts = _parts(L, parts)
        self._part_of = [p for p, (a, b) in enumerate(self.parts) for _ in range(a, b)]
        self._ready = [threading.Event() for _ in self.parts]
        self._events: list[Any] = [None] * len(self.parts)  # CUDA: one per part
        self._stream = _loader_stream(dev) if dev.type == "cuda" else None
        if self._stream is not None:  # the cache's memory may be what work still queued
            self._stream.wait_stream(torch.cuda.current_stream(dev))  # there freed: after it
        self._stop = threading.Event()
        self.owner = 0  # the thread whose forward waits (the others' never do)
        self.waited: set[int] = set()  # layers whose hook ran
        self._synced: set[int] = set()  # parts the compute stream waits for
        self.missed_at: int | None = None  # the first part that did not arrive
        self.error: Exception | None = None  # why, when the store raised
        # the loader thread: in inference mode (it updates inference tensors in place),
        # on the model's device and its own stream there (kvstore/copies/caller.py)
        index = None if self._stream is None else self._stream.device.index
        self._state = Caller(True, index, () if self._stream is None else (self._stream,))
        self._thread = threading.Thread(target=self._run, name="kvstore-layer-load", daemon=True)

    def start(self) -> None:
        """Start the loader; the calling thread's forward is the one that waits."""
        self.owner = threading.get_ident()
        self._thread.start()

    def join(self) -> None:
        """Stop the loader at its next batch and wait for it, and on a GPU for the
        copies it queued: a forward that stopped frees the cache's tensors, which must
        not be reused while a copy into them is still in flight."""
        self._stop.set()
        self._thread.join()
        if self._stream is not None:
            self._stream.synchronize()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s part has landed (on a GPU: order the caller's stream
        after its copies); raise :class:`PartMissed` when it did not arrive."""
        part = self._part_of[layer]
        self._ready[part].wait()
        if self.missed_at is not None and part >= self.missed_at:
            raise PartMissed(f"part {part} of the prefix did not arrive")
        self.waited.add(layer)
        if self._events[part] is not None and part not in self._synced:
            torch.cuda.current_stream(self.adapter.device).wait_event(self._events[part])
            self._synced.add(part)

    def _run(self) -> None:
        try:
            with as_caller(self._state):
                for p, (a, b) in enumerate(self.parts):
                    if not self._land(a, b):
                        self.missed_at = p
                        return
                    if self._stream is not None:
                        self._events[p] = torch.cuda.Event()
                        self._events[p].record(self._stream)
                    self._ready[p].set()
        except KVStoreError as exc:  # the store failed: a miss, said once
            self.error = exc
        except Exception:
            log.exception("layer-wise prefix load failed; the prompt is computed whole")
        finally:
            if self.missed_at is None:  # whatever ended the loop early: no part unlanded is read
                self.missed_at = next(
                    (p for p, e in enumerate(self._ready) if not e.is_set()), None
                )
            for e in self._ready:  # a failure must not leave the forward waiting
                e.set()

    def _land(self, a: int, b: int) -> bool:
        """Fetch layers ``a..b-1`` of every block and write them into the cache's
        tensors; False when any block did not arrive whole (or the load was stopped)."""
        ad, n = self.adapter, len(self.keys)
        _, _, H, B, D = ad.block_shape
        stage = torch.empty((n, b - a, 2, H, B, D), dtype=ad.dtype, device=ad.device)
        rows = list(stage.unbind(0))
        for i in range(0, n, BATCH_KEYS):
            part = self.keys[i : i + BATCH_KEYS]
            if self._stop.is_set():
                return False
            res = self.store.batch_get_into(
                part, rows[i : i + BATCH_KEYS], namespace=ad.namespace, layers=(a, b)
            )
            if leading_hits(res) < len(part):
                return False
        for li in range(a, b):  # [n, H, B, D] -> the cache's [1, H, n * B, D]
            for kv, dst in enumerate(self._dst[li]):
                dst.view(H, n, B, D).copy_(stage[:, li - a, kv].transpose(0, 1))
        return True


def _wait_hook(load: LayerwiseLoad, layer: int, module: Any, args: Any) -> None:
    if threading.get_ident() == load.owner:  # another thread's forward is not this load's
        load.wait(layer)


def forward_loading(
    adapter: HFKVAdapter,
    store: BlockStore,
    keys: Sequence[bytes],
    rest: Sequence[int],
    layers: Sequence[torch.nn.Module],
    parts: int = LAYER_PARTS,
) -> tuple[Any, LayerwiseLoad | None]:
    """The forward over ``rest`` (the prompt after the ``len(keys)`` stored blocks) while
    those blocks load beside it, each of ``layers`` (:func:`decoder_layers`) waiting
    for its own: (its output, the load). The output is None when a part missed or a
    layer ran without waiting (the caller computes the whole prompt; the load's
    ``error`` says when the store failed); the load is None when there are no blocks
    to load. Only the last position's logits are computed."""
    if not keys:
        return None, None
    load = LayerwiseLoad(adapter, store, keys, parts)
    hooks = [m.register_forward_pre_hook(functools.partial(_wait_hook, load, i))
             for i, m in enumerate(layers)]  # fmt: skip
    try:
        load.start()
        out = adapter.model(
            adapter.input_ids(rest), past_key_values=load.cache, use_cache=True, logits_to_keep=1
        )
    except PartMissed:
        return None, load
    finally:
        for h in hooks:
            h.remove()
        load.join()
    if len(load.waited) != len(layers):  # some layer read its KV unguarded: not used
        log.warning("a layer ran without waiting for its KV; the prompt is computed whole")
        return None, load
    return out, load
