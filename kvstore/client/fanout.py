"""Calls on several servers at once: the shards of a sharded node, the nodes of a cluster.

A call on a sharded node (kvstore/client/sharded.py) becomes one sub-call per shard it
involves, and a cluster client's call one per node holding its keys or per shard a
write is split over (kvstore/client/cluster_writes.py). One sub-call runs on the
caller's thread, since handing it to a thread costs ~60 us on this project's hosts, a
third of a 1 MiB shared-memory get (the common unsharded call pays nothing). Several
run side by side on a small pool created at the first such call, so their round trips
overlap (blocking socket I/O and copies release the GIL), and every one has finished
before the call returns: a read still landing in the caller's buffers after the call
returned would hand over bytes nobody checked, and a caller undoing what some started
when another failed must know them all.

:meth:`FanOut.run` (shards) makes a sub-call's KVStoreError its outcome (a shard down or
restarting fails its own keys, not the others') and raises anything else once all have
returned; :meth:`FanOut.each` (cluster nodes) hands back every result or exception for
the caller to sort into node failures and the call's own errors. :func:`share` splits
the time left among the attempts a call may still make, so a hung node costs its
share, not the whole deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.copies.caller import Caller, as_caller, capture
from kvstore.errors import ClosedError, KVStoreError, TimeoutError_

__all__ = ["FanOut", "Groups", "Item", "leading_run", "pick", "raise_any", "scatter", "share"]

T = TypeVar("T")
Groups = list[tuple[int, list[int]]]  # (shard, positions of its keys in the call)
Item = tuple[str, list[int]]  # a node id and the positions of the call's keys it gets


def _as_caller(caller: Caller | None, call: Callable[[], T]) -> T | KVStoreError:
    """``_outcome(call)`` on a pool thread, under the caller's CUDA streams and
    inference mode (kvstore/copies/caller.py)."""
    with as_caller(caller):
        return _outcome(call)


def _outcome(call: Callable[[], T]) -> T | KVStoreError:
    try:
        return call()
    except KVStoreError as exc:
        return exc


class FanOut:
    """Runs sub-calls in parallel on a lazily created pool of ``workers`` threads.

    Thread-safe; pool threads never submit to the pool, so a full pool only queues."""

    def __init__(self, workers: int, name: str = "kvstore-shards") -> None:
        self._workers = max(1, workers)
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T | KVStoreError]:
        """Each call's result or KVStoreError, in order (see the module docstring)."""
        if not calls:
            return []
        if len(calls) == 1:
            return [_outcome(calls[0])]
        pool, caller = self._executor(), capture()  # the pool copies as the caller would
        futures: list[Future[T | KVStoreError]] = [
            pool.submit(_as_caller, caller, c) for c in calls[1:]
        ]
        failure: BaseException | None = None
        out: list[T | KVStoreError] = []
        try:
            out.append(_outcome(calls[0]))
        except BaseException as exc:
            failure = exc
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return out

    def each(
        self, items: dict[str, list[int]], fn: Callable[[Item], Any]
    ) -> list[tuple[Item, Any]]:
        """``fn`` of each (node, positions) item, in parallel when there are several,
        each paired with its result or the exception it raised."""

        def one(item: Item) -> Any:
            try:
                return fn(item)
            except Exception as exc:
                return exc

        pairs = list(items.items())
        if len(pairs) <= 1:
            outs: Any = [one(it) for it in pairs]
        else:
            caller = capture()  # the pool's threads copy as the caller would

            def on_callers(item: Item) -> Any:
                with as_caller(caller):
                    return one(item)

            outs = self._executor().map(on_callers, pairs)
        return list(zip(pairs, outs, strict=True))

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The pool, started on first use (for callers that schedule their own work)."""
        return self._executor()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ClosedError("client is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
            return self._pool

    def close(self) -> None:
        """Let running sub-calls finish on their own; start no more threads."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=False)


# -- merging per-shard outcomes ------------------------------------------------------


def pick(seq: Sequence[Any], idx: list[int]) -> list[Any]:
    """``seq`` at positions ``idx``."""
    return [seq[i] for i in idx]


def raise_any(outcomes: Sequence[T | KVStoreError]) -> list[T]:
    """The outcomes of a call every shard must answer; the first shard's error raised."""
    for o in outcomes:
        if isinstance(o, KVStoreError):
            raise o
    return list(outcomes)  # type: ignore[arg-type]  # no error left among them


def scatter(n: int, groups: Groups, outcomes: Sequence[Any]) -> list[Any]:
    """Per-shard result lists back in the caller's order; a failed shard's keys get its
    error. Raises when every shard failed (as a whole node would)."""
    if all(isinstance(o, KVStoreError) for o in outcomes):
        raise outcomes[0]
    out: list[Any] = [None] * n
    for (_, idx), o in zip(groups, outcomes, strict=True):
        if isinstance(o, KVStoreError):
            for i in idx:
                out[i] = o
        else:
            for i, r in zip(idx, o, strict=True):
                out[i] = r
    return out


def leading_run(n: int, groups: Groups, matched: Sequence[int]) -> int:
    """The leading keys present over all shards, from each shard's leading run over its
    own keys (in call order): the call's prefix ends at the first key of any shard that
    shard lacks."""
    end = n
    for (_, idx), m in zip(groups, matched, strict=True):
        if m < len(idx):
            end = min(end, idx[m])
    return end


def share(deadline: float, tries: int) -> float:
    """One attempt's time: what is left until ``deadline`` split evenly among the
    ``tries`` attempts still possible (this one included); TimeoutError_ once past it."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError_("deadline passed before the call")
    return left / max(tries, 1)
