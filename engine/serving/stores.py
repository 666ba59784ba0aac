"""The store as a serving worker sees it: a guarded local node and a handoff reader.

A worker must keep serving when its store node dies: a store that cannot answer is
a cache miss and a recompute, never a failed request (and never a request stuck on
a dead node's timeout again and again). :class:`GuardedStore` wraps one client:
after a failure it answers "miss" at once for ``backoff_s`` before trying the node
again. :class:`HandoffReader` is what a decode worker reads a handoff through: the
nearest replica the cluster directory knows first, then the node the prefill worker
wrote to (its blocks may not have reached the directory's watch yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import Namespace
from kvstore.errors import KVStoreError, Unavailable

__all__ = ["GuardedStore", "HandoffReader"]

log = logging.getLogger(__name__)


class GuardedStore:
    """A store client that turns failures into misses and skips a failed node a while.

    ``connect`` opens the client (lazily, and again after a failure). Thread-safe.
    """

    def __init__(self, connect: Callable[[], Any], *, backoff_s: float = 2.0) -> None:
        self._connect = connect
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.backoff_s = backoff_s
        self.failures = 0

    def _get(self) -> Any:
        with self._lock:
            if time.monotonic() < self._down_until:
                raise Unavailable("store node marked down after a failure")
            if self._client is None:
                try:
                    self._client = self._connect()
                except KVStoreError as exc:
                    self._mark_down_locked(exc)
                    raise
            return self._client

    def _mark_down_locked(self, exc: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.backoff_s
        client, self._client = self._client, None
        log.warning("store node unavailable (%s); misses for %.1f s", exc, self.backoff_s)
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead client may fail too
                log.debug("closing a failed store client", exc_info=True)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        client = self._get()
        try:
            return fn(client)
        except KVStoreError as exc:
            if exc.retryable or isinstance(exc, Unavailable):
                with self._lock:
                    if self._client is client:
                        self._mark_down_locked(exc)
            raise

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        return bool(self._call(lambda c: c.put(key, value, namespace=namespace)))

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        return bool(self._call(lambda c: c.get_into(key, out, namespace=namespace)))

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self._call(lambda c: c.match_prefix(keys)))

    def remove(self, keys: Sequence[bytes]) -> int:
        return int(self._call(lambda c: c.remove(keys)))

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class HandoffReader:
    """Reads one handoff's blocks: nearest replica first, then the node written to.

    ``cluster`` is a cluster-wide client (``StoreClient.from_etcd``) or None;
    ``source`` the guarded client of the prefill worker's store node or None.
    """

    def __init__(self, cluster: Any, source: GuardedStore | None) -> None:
        self.cluster, self.source = cluster, source
        self.from_cluster = 0
        self.from_source = 0

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        raise KVStoreError("a handoff reader does not write")

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        if self.cluster is not None:
            try:
                if self.cluster.get_into(key, out):
                    self.from_cluster += 1
                    return True
            except KVStoreError as exc:
                log.info("cluster read failed (%s); trying the source node", exc)
        if self.source is not None:
            try:
                if self.source.get_into(key, out, namespace=namespace):
                    self.from_source += 1
                    return True
            except KVStoreError:
                return False
        return False

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        best = 0
        for store in (self.cluster, self.source):
            if store is None:
                continue
            try:
                best = max(best, int(store.match_prefix(keys)))
            except KVStoreError:
                continue
        return best
