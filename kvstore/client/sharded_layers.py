"""A layer-by-layer write to a sharded node: one layered put per shard, behind one.

``begin_layers`` on a sharded node (kvstore/client/sharded.py) starts each shard's own
layered put (kvstore/client/layered.py, LinkLayeredPut) over that shard's keys. The
caller writes layers as to one: each layer's runs are split by shard and sent to the
shards side by side, each shard's write hashing its own blocks; the commit commits
every shard's write and puts the per-key results back in the caller's order.

Failures follow the batch calls' rule: a shard whose write fails (at its start, a
layer, or its commit) is aborted, its keys get that error at the commit, and the other
shards' writes go on; when no shard's write is left, the error is raised and the write
is over, as one node's would be. The contract of a layered put holds shard by shard:
nothing is visible before the commit, and an abort (or leaving ``with`` without a
commit) frees every shard's reservations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.blocks import ValueInfo
from kvstore.client.fanout import FanOut
from kvstore.client.layered import LayeredPut
from kvstore.errors import KVStoreError

__all__ = ["ShardedLayeredPut"]

Part = tuple[list[int], LayeredPut | KVStoreError]  # positions of its keys, its write or error


def _runs_for(runs: list[list[Any]], idx: list[int]) -> Callable[[int], list[Any]]:
    """Layer ``j``'s runs of the items at positions ``idx``."""
    return lambda j: [runs[j][i] for i in idx]


class ShardedLayeredPut(LayeredPut):
    """One shard's layered put per group of keys (see the module docstring)."""

    def __init__(
        self,
        keys: Sequence[bytes],
        info: ValueInfo,
        timeout_s: float,
        parts: Sequence[Part],
        fan: FanOut,
    ) -> None:
        super().__init__(keys, info, timeout_s)
        self._parts = list(parts)
        self._fan = fan

    @classmethod
    def start(
        cls,
        keys: Sequence[bytes],
        info: ValueInfo,
        timeout_s: float,
        groups: Sequence[list[int]],
        started: Sequence[LayeredPut | KVStoreError],
        fan: FanOut,
    ) -> ShardedLayeredPut:
        """The write over the shards' writes as they started (an error where one did
        not); raises when none did."""
        if all(isinstance(w, KVStoreError) for w in started):
            raise started[0]  # type: ignore[misc]  # all are errors
        return cls(keys, info, timeout_s, list(zip(groups, started, strict=True)), fan)

    def _live(self) -> list[tuple[int, list[int], LayeredPut]]:
        return [(n, idx, w) for n, (idx, w) in enumerate(self._parts) if isinstance(w, LayeredPut)]

    def _send_runs(self, layer: int, k: int, parts_of: Callable[[int], list[Any]]) -> None:
        runs = [parts_of(j) for j in range(k)]
        live = self._live()
        calls = [functools.partial(w._send, layer, k, _runs_for(runs, idx)) for _, idx, w in live]
        outcomes = self._fan.run(calls)
        first: KVStoreError | None = None
        for (n, idx, _), o in zip(live, outcomes, strict=True):
            if isinstance(o, KVStoreError):  # that shard's write aborted itself
                self._parts[n] = (idx, o)
                first = first or o
        if first is not None and not self._live():
            raise first

    def _finish(self, flags: list[bool]) -> list[bool | KVStoreError | None]:
        live = self._live()
        calls = [functools.partial(w.commit, [flags[i] for i in idx]) for _, idx, w in live]
        results: list[bool | KVStoreError | None] = [None] * len(self.keys)
        for idx, w in self._parts:
            if isinstance(w, KVStoreError):  # failed before the commit
                for i in idx:
                    results[i] = w
        failed: list[KVStoreError] = []
        for (_, idx, _), o in zip(live, self._fan.run(calls), strict=True):
            if isinstance(o, KVStoreError):
                failed.append(o)
                for i in idx:
                    results[i] = o
            else:
                for i, r in zip(idx, o, strict=True):
                    results[i] = r
        if failed and len(failed) == len(live):  # no shard committed: failed as a whole
            raise failed[0]
        return results

    def abort(self) -> None:
        """Abort every shard's write still open; idempotent."""
        self._done = True
        failure: BaseException | None = None
        for _, w in self._parts:
            if isinstance(w, LayeredPut):
                try:
                    w.abort()
                except BaseException as exc:  # the other shards still free theirs
                    failure = failure or exc
        if failure is not None:
            raise failure
