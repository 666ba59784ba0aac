"""One layer-by-layer write whose keys went to several nodes.

A cluster client writes each key of a sharded node on the key's shard
(kvstore/client/groups.py), and a down shard's keys on the next node, so one
``begin_layers`` call may start a :class:`~kvstore.client.layered.LayeredPut` on each of
several nodes. :class:`SplitLayeredPut` is their sum with the caller's key order: each
layer range is cut by part and sent to every part at once, the commit gathers each
part's results back into key order. The contract is LayeredPut's (layered.py), with
one addition that only a split write can meet: a part whose node fails at the commit
reports its keys with that error while the other parts' keys are stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Self

from kvstore.blocks import describe
from kvstore.client.layered import LayeredPut
from kvstore.errors import InvalidValue, KVStoreError, ReservationError

__all__ = ["SplitLayeredPut"]

log = logging.getLogger(__name__)

Part = tuple[list[int], LayeredPut]  # the caller's positions of a part's keys, its write


class SplitLayeredPut:
    """Layered writes on several nodes, used as one (see the module docstring).

    Not thread-safe, as LayeredPut: one writer thread at a time. The parts' own
    ``on_commit`` hooks (where their keys went) run at their commits; this write's
    ``on_commit`` runs once with every key's result.
    """

    def __init__(self, count: int, parts: Sequence[Part], pool: Executor) -> None:
        placed = sorted(i for idx, _ in parts for i in idx)
        if placed != list(range(count)):
            raise ValueError(f"parts cover positions {placed[:8]}..., not 0-{count - 1}")
        self.parts = list(parts)
        self.keys: list[bytes] = [b""] * count
        for idx, w in self.parts:
            for i, k in zip(idx, w.keys, strict=True):
                self.keys[i] = k
        self.on_commit: Callable[[Sequence[Any]], None] | None = None
        self._pool = pool
        self._done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    @property
    def written(self) -> int:
        """Layers written so far (the same on every part)."""
        return min((w.written for _, w in self.parts), default=0)

    @property
    def done(self) -> bool:
        """Committed or aborted."""
        return self._done

    def write(self, layer: int, values: Sequence[Any]) -> None:
        """See :meth:`LayeredPut.write`: one value per key, in key order."""
        self._check_live()
        if len(values) != len(self.keys):
            raise InvalidValue(f"{len(values)} values for {len(self.keys)} keys")
        self._send(lambda idx, w: w.write(layer, [values[i] for i in idx]))

    def write_stacked(self, layer: int, stacked: Any) -> None:
        """See :meth:`LayeredPut.write_stacked`: each part gets its own blocks' columns
        of ``stacked`` (a copy: its blocks are not adjacent in the caller's order)."""
        self._check_live()
        shape = describe(stacked).shape
        if len(shape) < 2 or shape[1] != len(self.keys):
            raise InvalidValue(f"stacked layers of shape {list(shape)} for {len(self.keys)} blocks")
        self._send(lambda idx, w: w.write_stacked(layer, stacked[:, idx]))

    def _send(self, step: Callable[[list[int], LayeredPut], None]) -> None:
        """Run ``step`` on every part at once; if one fails, abort them all (a part
        that failed has aborted itself) and raise its error."""
        errors = [e for e in self._map(lambda p: step(*p)) if e is not None]
        if errors:
            try:
                self.abort()
            except KVStoreError as exc:  # the write failed already: say why it did
                log.info("aborting a split layered write after a failure: %s", exc)
            raise errors[0]

    def commit(self, keep: Sequence[bool] | None = None) -> list[bool | KVStoreError | None]:
        """Store every block whose ``keep`` is true (all by default): per key True,
        False (stored already), None (withdrawn) or its error. A part that fails
        reports its error on each of its keys; when every part fails, the error is
        raised, as one LayeredPut's would be."""
        self._check_live()
        if keep is not None and len(keep) != len(self.keys):
            raise InvalidValue(f"{len(keep)} keep flags for {len(self.keys)} keys")
        for _, w in self.parts:  # refuse before any part commits
            if w.written != w.layers:
                raise InvalidValue(f"commit after layers [0, {w.written}) of {w.layers}")
        self._done = True
        flags = [True] * len(self.keys) if keep is None else [bool(k) for k in keep]
        outs = self._map(lambda p: p[1].commit([flags[i] for i in p[0]]))
        failed = [o for o in outs if isinstance(o, BaseException)]
        if failed and len(failed) == len(outs):
            raise failed[0]
        for o in failed:
            if not isinstance(o, KVStoreError):
                raise o
        results: list[bool | KVStoreError | None] = [None] * len(self.keys)
        for (idx, _), out in zip(self.parts, outs, strict=True):
            for n, i in enumerate(idx):
                results[i] = out if isinstance(out, KVStoreError) else out[n]
        if self.on_commit is not None:
            self.on_commit(results)
        return results

    def abort(self) -> None:
        """Store nothing of any part and free every reservation; idempotent."""
        self._done = True
        errors = [e for e in self._map(lambda p: p[1].abort()) if e is not None]
        if errors:
            raise errors[0]

    def _map(self, fn: Callable[[Part], Any]) -> list[Any]:
        """``fn`` of every part, in parallel; each result or the exception it raised."""

        def one(part: Part) -> Any:
            try:
                return fn(part)
            except Exception as exc:
                return exc

        return list(self._pool.map(one, self.parts))

    def _check_live(self) -> None:
        if self._done:
            raise ReservationError("this layer-by-layer write was already committed or aborted")
