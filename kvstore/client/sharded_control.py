"""Control RPCs (``StoreClient.control``) on a sharded node, answered for the node.

Admin tooling (kvstore/client/admin.py, drain.py, the ``kvstore`` commands) sends
control RPCs through a StoreClient and expects one node to answer. On a node sharded
across processes (kvstore/client/sharded.py) each RPC goes where its subject lives and
the replies are merged into the one reply a whole node would give:

- by the caller's keys (the keys a data call names): ``Exists``, ``Lookup``,
  ``MatchPrefix``, ``Remove`` go to each key's shard (``shard_of``), replies back in
  key order (MatchPrefix: the leading run over all shards; Remove: summed).
- by stored keys (tenant-scoped, as the node holds them and Scan lists them; they do
  not tell their shard): ``Export`` asks every shard for every key and takes the shard
  that has each; ``Purge`` asks every shard and sums.
- ``Import`` sends each block to shard ``shard_of(stored key)``, where its owner's
  own puts would have put it (placement is by stored key, kvstore/client/sharded.py),
  so a block a drain moves into a sharded node is found by its owner's clients.
- the node as a whole: ``Scan`` (every shard's list, at most ``limit`` in all, ``more``
  if any shard had more or the merge cut some), ``Evict`` (each shard holds 1/N of
  the tier, so each is asked down to 1/N of ``target_bytes``; counts and bytes summed,
  listed blocks merged up to ``list_limit``), ``Stats`` (summed, as
  :func:`merge_stats`), ``Drain`` (every shard; draining when any is) and ``Health``
  (draining when any shard is).
- anything else (``Info``): shard 0, which speaks for the node.

A shard that fails fails the RPC (admin tooling reports a node's error per node), once
every shard has answered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvstore._proto import store_pb2 as pb
from kvstore.client.fanout import Groups, leading_run, pick, raise_any
from kvstore.client.store import NodeClient
from kvstore.errors import KVStoreError
from kvstore.wire.codec import stats_from_proto, stats_to_proto

__all__ = ["Shards", "merge_stats", "shard_control"]

T = TypeVar("T")


class Shards(Protocol):
    """What the RPCs here need of a sharded node's client (kvstore/client/sharded.py,
    ShardedClient): its shards, and running a call on each."""

    first: NodeClient  # shard 0's client
    count: int
    group: str

    def split(self, keys: Sequence[bytes]) -> Groups: ...

    def split_stored(self, stored: Sequence[bytes]) -> Groups: ...

    def each_group(
        self,
        groups: Groups,
        call: Callable[[NodeClient, list[int]], T],
        timeout: float | None = None,
    ) -> list[T | KVStoreError]: ...

    def each_shard(
        self, call: Callable[[NodeClient], T], timeout: float | None = None
    ) -> list[T | KVStoreError]: ...


Handler = Callable[[Shards, Any, "float | None"], Any]
_FLAGS = ("draining",)  # server stats that say yes or no: any shard's yes is the node's


def shard_control(sc: Shards, method: str, request: Any, timeout: float | None) -> Any:
    """One control RPC by name on the sharded node (see the module docstring)."""
    handler = _HANDLERS.get(method)
    if handler is None:
        return NodeClient.control(sc.first, method, request, timeout=timeout)
    return handler(sc, request, timeout)


def merge_stats(group: str, per: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The node's stats from its shards': numeric leaves summed (flags such as
    ``draining``: any), ``node_id`` the node's name, each shard's own under
    ``"shards"`` in shard order."""
    merged = _sum_tree(per)
    merged["node_id"] = group
    server = merged.get("server")
    if isinstance(server, dict):
        for name in _FLAGS:
            if name in server:
                server[name] = max(int(p.get("server", {}).get(name, 0)) for p in per)
    merged["shards"] = list(per)
    return merged


def _sum_tree(trees: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in trees:
        for k, v in t.items():
            if k not in out:
                out[k] = dict(v) if isinstance(v, dict) else v
            elif isinstance(v, dict) and isinstance(out[k], dict):
                out[k] = _sum_tree([out[k], v])
            elif _number(v) and _number(out[k]):
                out[k] += v
    return out


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# -- by the caller's keys ----------------------------------------------------------------


def _by_key(sc: Shards, method: str, request: Any, timeout: float | None) -> Any:
    """(groups, each shard's reply to the RPC over its own keys)."""
    keys = list(request.keys)
    groups = sc.split(keys)

    def call(c: NodeClient, idx: list[int]) -> Any:
        return NodeClient.control(c, method, pb.KeysRequest(keys=pick(keys, idx)), timeout=timeout)

    return groups, raise_any(sc.each_group(groups, call, timeout))


def _in_key_order(groups: Any, replies: Sequence[Sequence[Any]], n: int) -> list[Any]:
    out: list[Any] = [None] * n
    for (_, idx), got in zip(groups, replies, strict=True):
        for i, v in zip(idx, got, strict=True):
            out[i] = v
    return out


def _exists(sc: Shards, request: Any, timeout: float | None) -> Any:
    groups, replies = _by_key(sc, "Exists", request, timeout)
    present = _in_key_order(groups, [r.present for r in replies], len(request.keys))
    return pb.ExistsResponse(present=present)


def _lookup(sc: Shards, request: Any, timeout: float | None) -> Any:
    groups, replies = _by_key(sc, "Lookup", request, timeout)
    return pb.LookupResponse(
        tier=_in_key_order(groups, [r.tier for r in replies], len(request.keys))
    )


def _match_prefix(sc: Shards, request: Any, timeout: float | None) -> Any:
    groups, replies = _by_key(sc, "MatchPrefix", request, timeout)
    matched = leading_run(len(request.keys), groups, [int(r.matched) for r in replies])
    return pb.MatchPrefixResponse(matched=matched)


def _remove(sc: Shards, request: Any, timeout: float | None) -> Any:
    _, replies = _by_key(sc, "Remove", request, timeout)
    return pb.RemoveResponse(removed=sum(int(r.removed) for r in replies))


# -- by stored keys ------------------------------------------------------------------


def _every(sc: Shards, method: str, request: Any, timeout: float | None) -> list[Any]:
    """Every shard's reply to the same RPC."""
    return raise_any(
        sc.each_shard(lambda c: NodeClient.control(c, method, request, timeout=timeout), timeout)
    )


def _export(sc: Shards, request: Any, timeout: float | None) -> Any:
    replies = _every(sc, "Export", request, timeout)
    out = pb.GetResponse()
    for i in range(len(request.keys)):
        refs = [r.blocks[i] for r in replies if i < len(r.blocks)]
        found = [b for b in refs if b.found] or [b for b in refs if b.error.code] or refs[:1]
        out.blocks.append(found[0] if found else pb.BlockRef())
    return out


def _purge(sc: Shards, request: Any, timeout: float | None) -> Any:
    return pb.RemoveResponse(
        removed=sum(int(r.removed) for r in _every(sc, "Purge", request, timeout))
    )


def _import(sc: Shards, request: Any, timeout: float | None) -> Any:
    items = list(request.items)
    groups = sc.split_stored([it.key for it in items])

    def call(c: NodeClient, idx: list[int]) -> Any:
        sub = pb.PutRequest(scope=request.scope, items=pick(items, idx))
        return NodeClient.control(c, "Import", sub, timeout=timeout)

    replies = raise_any(sc.each_group(groups, call, timeout))
    out = pb.PutResponse()
    out.results.extend(_in_key_order(groups, [r.results for r in replies], len(items)))
    return out


# -- the node as a whole -------------------------------------------------------------


def _scan(sc: Shards, request: Any, timeout: float | None) -> Any:
    replies = _every(sc, "Scan", request, timeout)
    blocks = [b for r in replies for b in r.blocks]
    limit = int(request.limit)
    cut = bool(limit) and len(blocks) > limit
    out = pb.ScanResponse(more=cut or any(r.more for r in replies))
    out.blocks.extend(blocks[:limit] if limit else blocks)
    return out


_EVICT_SUMS = (
    *("moved", "skipped_pinned", "bytes", "demoted", "dropped"),
    *("used_before", "used_after", "capacity"),
)


def _evict(sc: Shards, request: Any, timeout: float | None) -> Any:
    n, target = sc.count, int(request.target_bytes)

    def call(c: NodeClient, shard: int) -> Any:
        sub = pb.EvictRequest()
        sub.CopyFrom(request)
        sub.target_bytes = target // n + (1 if shard < target % n else 0)
        return NodeClient.control(c, "Evict", sub, timeout=timeout)

    groups = [(s, [s]) for s in range(n)]
    replies = raise_any(sc.each_group(groups, lambda c, idx: call(c, idx[0]), timeout))
    out = pb.EvictResponse(dry_run=any(r.dry_run for r in replies))
    for f in _EVICT_SUMS:
        setattr(out, f, sum(int(getattr(r, f)) for r in replies))
    out.next_tier = next((r.next_tier for r in replies if r.next_tier), "")
    listed = [b for r in replies for b in r.blocks]
    out.blocks.extend(listed[: int(request.list_limit)])
    return out


def _stats(sc: Shards, request: Any, timeout: float | None) -> Any:
    per = [stats_from_proto(r) for r in _every(sc, "Stats", request, timeout)]
    merged = merge_stats(sc.group, per)
    return stats_to_proto(merged, merged["server"])


def _drain(sc: Shards, request: Any, timeout: float | None) -> Any:
    replies = _every(sc, "Drain", request, timeout)
    return pb.DrainResponse(draining=any(r.draining for r in replies))


def _health(sc: Shards, request: Any, timeout: float | None) -> Any:
    replies = _every(sc, "Health", request, timeout)
    out = pb.HealthResponse()
    out.CopyFrom(replies[0])
    if any(r.status == pb.HealthResponse.DRAINING for r in replies):
        out.status = pb.HealthResponse.DRAINING
    return out


_HANDLERS: dict[str, Handler] = {
    "Exists": _exists,
    "Lookup": _lookup,
    "MatchPrefix": _match_prefix,
    "Remove": _remove,
    "Export": _export,
    "Purge": _purge,
    "Import": _import,
    "Scan": _scan,
    "Evict": _evict,
    "Stats": _stats,
    "Drain": _drain,
    "Health": _health,
}
