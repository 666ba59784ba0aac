"""Conversions between the wire messages (kvstore/_proto) and the store's own types.

Both ends use these, so a field means the same thing on the server and the client. What
arrives from the network is validated here before the node sees it: a ValueMeta whose
dtype, shape and byte count disagree is an InvalidValue, never a header the node packs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import KIND_TORCH, MAX_DIMS, ValueInfo
from kvstore.errors import (
    ClosedError,
    InvalidValue,
    KVStoreError,
    Unavailable,
    error_for_code,
)
from kvstore.keys import Namespace
from kvstore.layout import DTYPE_SIZES

__all__ = [
    "MAX_SCAN",
    "error_of",
    "info_from_meta",
    "meta_of",
    "scope_of",
    "stats_from_proto",
    "stats_to_proto",
    "status_of",
    "wire_error",
]

MAX_SCAN = 4096
"""Blocks one Scan reply lists at most: a few hundred KiB of metadata."""


def scope_of(namespace: Namespace | None) -> pb.Scope:
    """The request scope of a client namespace: model and layout (never the tenant)."""
    if namespace is None:
        return pb.Scope()
    return pb.Scope(model=namespace.model, layout=namespace.layout)


def meta_of(info: ValueInfo) -> pb.ValueMeta:
    """A ValueInfo on the wire."""
    return pb.ValueMeta(dtype=info.dtype, shape=info.shape, kind=info.kind, nbytes=info.nbytes)


def info_from_meta(meta: pb.ValueMeta) -> ValueInfo:
    """A ValueInfo from the wire, checked: known dtype and kind, shape x itemsize == nbytes."""
    if meta.dtype not in DTYPE_SIZES:
        raise InvalidValue(f"unknown dtype {meta.dtype!r}")
    if meta.kind > KIND_TORCH:
        raise InvalidValue(f"unknown value kind {meta.kind}")
    shape = tuple(int(d) for d in meta.shape)
    if not shape or len(shape) > MAX_DIMS or any(d >= 1 << 32 for d in shape):
        raise InvalidValue(f"shape {shape}: 1 to {MAX_DIMS} dimensions below 2**32")
    n = DTYPE_SIZES[meta.dtype]
    for d in shape:
        n *= d
    if n != meta.nbytes or n == 0:
        raise InvalidValue(f"shape {shape} x {meta.dtype} is {n} bytes, meta says {meta.nbytes}")
    return ValueInfo(meta.dtype, shape, int(meta.kind), int(meta.nbytes))


def wire_error(exc: KVStoreError) -> KVStoreError:
    """A server-side error as a remote caller should see it.

    The node closing under a request means the server is going away: the caller gets a
    retryable Unavailable, not a ClosedError it would read as its own client closing.
    """
    if isinstance(exc, ClosedError):
        return Unavailable(f"server is shutting down ({exc})")
    return exc


def status_of(exc: KVStoreError) -> pb.Status:
    """A per-item failure on the wire."""
    exc = wire_error(exc)
    return pb.Status(code=exc.code, message=str(exc))


def error_of(status: pb.Status) -> KVStoreError | None:
    """The typed error of a per-item status (None when the item did not fail)."""
    if not status.code:
        return None
    return error_for_code(status.code, status.message)


def stats_to_proto(stats: Mapping[str, Any], server: Mapping[str, int]) -> pb.StatsResponse:
    """Node stats (StoreNode.stats()) plus server counters as a StatsResponse."""
    resp = pb.StatsResponse(
        node_id=stats["node_id"],
        blocks=stats["blocks"],
        pinned=stats["pinned"],
        events_dropped=stats["events_dropped"],
    )
    for name, t in stats["tiers"].items():
        resp.tiers.add(tier=name, capacity=t["capacity"], used=t["used"], blocks=t["blocks"])
    resp.counters.update({k: _int64(v) for k, v in stats["counters"].items()})
    resp.server.update({k: _int64(v) for k, v in server.items()})
    return resp


_INT64_MAX = (1 << 63) - 1


def _int64(v: int) -> int:
    """A counter as the wire's int64 can carry it (saturating): one counter gone wild
    must not take the whole Stats answer with it."""
    return max(-_INT64_MAX - 1, min(int(v), _INT64_MAX))


def stats_from_proto(resp: pb.StatsResponse) -> dict[str, Any]:
    """The inverse of :func:`stats_to_proto`: the same plain dict StoreNode.stats() gives,
    plus a ``server`` entry."""
    return {
        "node_id": resp.node_id,
        "tiers": {
            t.tier: {"capacity": t.capacity, "used": t.used, "blocks": t.blocks} for t in resp.tiers
        },
        "blocks": resp.blocks,
        "pinned": resp.pinned,
        "events_dropped": resp.events_dropped,
        "counters": dict(resp.counters),
        "server": dict(resp.server),
    }
