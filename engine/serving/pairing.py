"""Which prefill and decode workers of a model can hand KV to each other: codec pools.

A handoff is blocks in the prefill worker's namespace, and a compressed namespace's
blocks are the codec's bytes (kvstore/codec/). A decode worker that stores another
codec (or none) computes other keys and another layout fingerprint, so at best it
misses every block and recomputes the prompt; the router never sends it such a
handoff. Workers of one model are split into pools by ``kv_codec``, and a split
request (prefill here, decode there) is placed inside one pool.

A pool with prefill workers and no decode worker, or decode workers and no prefill
worker while the model has prefill workers elsewhere, cannot serve a long prompt: its
workers are *unpaired*. The router logs them, shows them in ``/health``, and answers a
request that only such workers could serve with :class:`CodecMismatch` (HTTP 503,
``kv_codec_mismatch``), never with a handoff between codecs. A model with no prefill
workers at all is not a mismatch: its decode workers serve every prompt whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.planning.scheduler import Refusal
from engine.registry import WorkerRecord

__all__ = [
    "CodecMismatch",
    "UnpairedLog",
    "codec_pools",
    "describe_codecs",
    "mismatch",
    "unpaired",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecMismatch(Refusal):
    """No prefill and decode worker of the model store the same KV codec: a
    configuration fault (503), not an overload (429)."""


def codec_pools(workers: Iterable[WorkerRecord]) -> dict[str, list[WorkerRecord]]:
    """codec -> the workers storing it, in the order given."""
    pools: dict[str, list[WorkerRecord]] = {}
    for w in workers:
        pools.setdefault(w.kv_codec, []).append(w)
    return pools


def unpaired(workers: Sequence[WorkerRecord]) -> list[WorkerRecord]:
    """Workers of one model that no worker of the other role shares a codec with
    (empty when the model has no prefill workers: decode workers then serve alone)."""
    if not any(w.can_prefill for w in workers):
        return []
    out = []
    for pool in codec_pools(workers).values():
        if not any(w.can_decode for w in pool) or not any(w.can_prefill for w in pool):
            out.extend(pool)
    return out


def _names(workers: Iterable[WorkerRecord]) -> str:
    return ", ".join(f"{w.worker_id} ({w.kv_codec})" for w in workers)


def mismatch(workers: Sequence[WorkerRecord]) -> CodecMismatch:
    """The refusal for a long prompt of a model whose prefill and decode workers share
    no codec: it names every worker and its codec."""
    pre = [w for w in workers if w.can_prefill]
    dec = [w for w in workers if w.can_decode]
    return CodecMismatch(
        f"no decode worker stores the same KV codec as a prefill worker, so none can "
        f"read a prefill's KV: prefill workers {_names(pre)}; decode workers {_names(dec)}. "
        "Start the model's workers with the same --kv-codec."
    )


def describe_codecs(workers: Sequence[WorkerRecord]) -> dict[str, Any]:
    """What ``/v1/models`` and ``/health`` say of one model's pools: ``kv_codec`` (the
    codec when every worker agrees, else ``mixed``), ``kv_codecs`` (codec -> worker
    ids) and ``unpaired`` (ids of workers no counterpart shares a codec with)."""
    pools = codec_pools(workers)
    codec = next(iter(pools)) if len(pools) == 1 else "mixed"
    return {
        "kv_codec": codec,
        "kv_codecs": {c: sorted(w.worker_id for w in ws) for c, ws in sorted(pools.items())},
        "unpaired": sorted(w.worker_id for w in unpaired(workers)),
    }


class UnpairedLog:
    """Logs each unpaired worker once per registration (its ``boot_id``), called on
    every change of the router's worker view: a worker started with the wrong
    ``--kv-codec`` shows up in the router's log when it registers, not at the first
    request it cannot serve."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def check(self, workers: Iterable[WorkerRecord]) -> None:
        by_model: dict[str, list[WorkerRecord]] = {}
        for w in workers:
            by_model.setdefault(w.model, []).append(w)
        now = set()
        for model, ws in sorted(by_model.items()):
            for w in unpaired(ws):
                now.add((w.worker_id, w.boot_id))
                if (w.worker_id, w.boot_id) in self._logged:
                    continue
                log.warning(
                    "worker %s (%s, model %s) stores KV codec %s, which no %s worker of its "
                    "model stores: it gets no split requests (start the model's workers "
                    "with the same --kv-codec)", w.worker_id, w.role, model, w.kv_codec,
                    "decode" if w.can_prefill else "prefill",
                )  # fmt: skip
        self._logged = now
