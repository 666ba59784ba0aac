"""Running one sub-call per shard of a sharded node, side by side, and putting their
outcomes back together.

A call on a sharded node (kvstore/client/sharded.py) becomes one sub-call per shard it
involves. One shard: the sub-call runs on the caller's thread, since handing it to a
thread costs ~60 us on this project's hosts, a third of a 1 MiB shared-memory get.
Several: the first runs on the caller's thread and the rest on a small pool created at
the first such call, so their round trips overlap (blocking socket I/O and copies
release the GIL).

A sub-call's KVStoreError is its outcome (a shard down or restarting fails its own
keys, not the others'); any other exception is a bug or a bad argument and is raised,
but only once every sub-call has returned: a read still landing in the caller's buffers
after the call returned would hand over bytes nobody checked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.errors import ClosedError, KVStoreError

__all__ = ["Fanout", "Groups", "leading_run", "pick", "raise_any", "scatter"]

T = TypeVar("T")
Groups = list[tuple[int, list[int]]]  # (shard, positions of its keys in the call)


def _outcome(call: Callable[[], T]) -> T | KVStoreError:
    try:
        return call()
    except KVStoreError as exc:
        return exc


class Fanout:
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
        if len(calls) == 1:
            return [_outcome(calls[0])]
        pool = self._executor()
        futures: list[Future[T | KVStoreError]] = [pool.submit(_outcome, c) for c in calls[1:]]
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

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ClosedError("StoreClient is closed")
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
