"""Where a cluster client's writes go: the write order's units, each key on its shard.

:class:`~kvstore.client.cluster.ClusterClient` checks the call and makes the keys;
:class:`ClusterWrites` sends them. It walks :meth:`Members.write_plan` (the writer first,
kvstore/client/members.py): each unit takes the keys it can (a whole node all of them,
a sharded node each key on its live ``shard_of`` shard, kvstore/client/groups.py), its
nodes in parallel; keys of a node that failed, of a missing shard, or with a retryable
error move on to the next unit, within their share of the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.fanout import FanOut, Item, share
from kvstore.client.layered import LayeredPut, LayerWrite, block_info
from kvstore.client.members import NODE_FAILURES, Members
from kvstore.client.parted_layers import PartedLayeredPut
from kvstore.errors import KVStoreError, Unavailable

__all__ = ["ClusterWrites"]

Remember = Callable[[bytes, str], None]  # (scoped key, node id): a put this client made


class ClusterWrites:
    """The write path of one ClusterClient (thread-safe: it holds no state of its own).

    ``remember`` is told each stored key's directory key and node, so the client's
    own reads find it before the directory lists it.
    """

    def __init__(self, members: Members, fan: FanOut, remember: Remember, cluster: str) -> None:
        self.members = members
        self.fan = fan
        self.remember = remember
        self.cluster = cluster

    def batch_put(
        self, ks: list[bytes], scoped: list[bytes], values: Sequence[Any], deadline: float
    ) -> list[bool | KVStoreError]:
        """Per key: True stored, False there already, or its error (see the module
        docstring); Unavailable when some key found no node at all."""
        results: list[Any] = [None] * len(ks)
        todo = list(range(len(ks)))
        members = self.members
        plan = members.write_plan()
        for n, unit in enumerate(plan):
            if not todo:
                break
            placed, todo = unit.split(scoped, todo, members.usable)
            left = share(deadline, len(plan) - n)

            def put(item: Item, left: float = left) -> Any:
                node_id, idx = item
                sub_v = [values[i] for i in idx]
                return members.client(node_id).batch_put([ks[i] for i in idx], sub_v, timeout=left)

            done = self.fan.each(placed, put)
            for (node_id, idx), out in done:
                if isinstance(out, NODE_FAILURES):
                    members.suspect(node_id, out)
                    todo += idx
                    continue
                if isinstance(out, KVStoreError):  # that node refused the call: its keys'
                    out = [out] * len(idx)
                elif isinstance(out, BaseException):  # not ours: after the rest is noted
                    continue
                for i, r in zip(idx, out, strict=True):
                    results[i] = r
                    if isinstance(r, bool):
                        self.remember(scoped[i], node_id)
                    elif r.retryable:
                        todo.append(i)
            for _, out in done:  # a bug's exception, raised once the rest is noted
                if isinstance(out, BaseException) and not isinstance(out, KVStoreError):
                    raise out
            todo.sort()  # sub-batches keep the caller's order
        if any(r is None for r in results):
            raise Unavailable(f"no live node of cluster {self.cluster!r} accepted the write")
        return results

    def begin_layers(
        self,
        ks: list[bytes],
        scoped: list[bytes],
        shape: Sequence[int],
        dtype: Any,
        deadline: float,
    ) -> LayerWrite:
        """A layered write of every key: one node's LayeredPut when one node took them
        all, else a PartedLayeredPut over the nodes that did. A node that cannot start
        passes its keys on; an error of the call itself aborts whatever started."""
        info = block_info(shape, dtype)  # bad input: one clear error, before any node
        members = self.members
        plan = members.write_plan()
        parts: list[tuple[list[int], LayeredPut]] = []
        todo = list(range(len(ks)))
        try:
            for n, unit in enumerate(plan):
                if not todo and (parts or ks):  # no keys: an empty write on the writer
                    break
                placed, todo = unit.split(scoped, todo, members.usable)
                left = share(deadline, len(plan) - n)

                def begin(item: Item, left: float = left) -> Any:
                    c = members.client(item[0])
                    sub = [ks[i] for i in item[1]]
                    return c.begin_layers(sub, shape=shape, dtype=dtype, timeout=left)

                done = self.fan.each(placed, begin)
                for (node_id, idx), w in done:
                    if isinstance(w, NODE_FAILURES):
                        members.suspect(node_id, w)
                        todo += idx
                    elif not isinstance(w, Exception):
                        w.on_commit = self._stored_by(node_id, [scoped[i] for i in idx])
                        parts.append((idx, w))
                raise_other(done)  # after keeping what started, for the abort below
                todo.sort()
            if todo:
                raise Unavailable(f"no live node of cluster {self.cluster!r} took the write")
        except BaseException:
            for _, w in parts:
                w.abort()
            raise
        if len(parts) == 1:
            return parts[0][1]  # one node took every key, in order
        left = max(deadline - time.monotonic(), 0.0)
        return PartedLayeredPut(ks, info, left, parts, self.fan)

    def _stored_by(self, node_id: str, scoped: list[bytes]) -> Callable[[Sequence[Any]], None]:
        """A layered write's commit hook: its stored keys are on ``node_id`` now."""

        def stored(results: Sequence[Any]) -> None:
            for key, r in zip(scoped, results, strict=True):
                if isinstance(r, bool):
                    self.remember(key, node_id)

        return stored


def raise_other(done: Sequence[tuple[Item, Any]]) -> None:
    """Raise the first error of :meth:`FanOut.each`'s results that is not a node's
    failure (those move the keys to another node; the rest are the call's)."""
    for _, out in done:
        if isinstance(out, Exception) and not isinstance(out, NODE_FAILURES):
            raise out
