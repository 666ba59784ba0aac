"""One layer-by-layer write whose keys went to several places, used as one.

Two callers split a ``begin_layers`` call: a StoreClient of a sharded node
(kvstore/client/sharded.py) starts one layered put (kvstore/client/layered.py) per shard
holding keys, and a cluster client (kvstore/client/cluster_writes.py) one per node, or
per shard of a sharded node, its keys were placed on. :class:`PartedLayeredPut` is
their sum with the caller's key order: the caller writes layers as to one write; each
layer's runs are cut by part and sent to the parts side by side, each part hashing its
own blocks; the commit commits every part and puts the per-key results back in the
caller's order.

Failures follow the batch calls' rule: a part whose write fails (at its start, a layer,
or its commit) is aborted, its keys get that error at the commit, and the other parts
go on, so a cache keeps every block that could be stored; when no part is left, the
error is raised and the write is over, as one node's would be. The contract of a
layered put holds part by part: nothing is visible before the commit, and an abort (or
leaving ``with`` without a commit) frees every part's reservations. Each part's own
``on_commit`` hook (where a cluster client's keys went) runs at its commit; this
write's runs once with every key's result.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.blocks import ValueInfo
from kvstore.client.fanout import FanOut
from kvstore.client.layered import LayeredPut
from kvstore.errors import KVStoreError

__all__ = ["PartedLayeredPut"]

Part = tuple[list[int], LayeredPut | KVStoreError]  # positions of its keys, its write or error


def _runs_for(runs: list[list[Any]], idx: list[int]) -> Callable[[int], list[Any]]:
    """Layer ``j``'s runs of the items at positions ``idx``."""
    return lambda j: [runs[j][i] for i in idx]


class PartedLayeredPut(LayeredPut):
    """One layered put per part of the keys (see the module docstring)."""

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
        started: Sequence[LayeredPut | Exception],
        fan: FanOut,
    ) -> PartedLayeredPut:
        """The write over the parts' writes as they started (an error where one did
        not; ``groups[i]``: the caller's positions of part ``i``'s keys); raises when
        none did. An exception that is not a KVStoreError is a bug's, not a failed
        part's: the parts that started are aborted (their reservations freed now, not
        when their leases run out) and it is raised."""
        bug = next((w for w in started if not isinstance(w, LayeredPut | KVStoreError)), None)
        if bug is not None:
            for w in started:
                if isinstance(w, LayeredPut):
                    with contextlib.suppress(Exception):  # its lease frees it then
                        w.abort()
            raise bug
        if all(isinstance(w, KVStoreError) for w in started):
            raise started[0]  # type: ignore[misc]  # all are errors
        parts = [(idx, w) for idx, w in zip(groups, started, strict=True)]
        return cls(keys, info, timeout_s, parts, fan)  # type: ignore[arg-type]  # no bugs

    def _live(self) -> list[tuple[int, list[int], LayeredPut]]:
        return [(n, idx, w) for n, (idx, w) in enumerate(self._parts) if isinstance(w, LayeredPut)]

    def _send_runs(self, layer: int, k: int, parts_of: Callable[[int], list[Any]]) -> None:
        runs = [parts_of(j) for j in range(k)]
        live = self._live()
        calls = [functools.partial(w._send, layer, k, _runs_for(runs, idx)) for _, idx, w in live]
        outcomes = self._fan.run(calls)
        first: KVStoreError | None = None
        for (n, idx, _), o in zip(live, outcomes, strict=True):
            if isinstance(o, KVStoreError):  # that part's write aborted itself
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
        if failed and len(failed) == len(live):  # no part committed: failed as a whole
            raise failed[0]
        return results

    def abort(self) -> None:
        """Abort every part's write still open; idempotent."""
        self._done = True
        failure: BaseException | None = None
        for _, w in self._parts:
            if isinstance(w, LayeredPut):
                try:
                    w.abort()
                except BaseException as exc:  # the other parts still free theirs
                    failure = failure or exc
        if failure is not None:
            raise failure
