"""How a decode worker reads a handoff: the nearest replica, then the node written to.

A worker's own store node sits behind the circuit breaker of engine/blockstore.py
(``GuardedStore``): a node that cannot answer is a cache miss and a recompute, never a
failed request. :class:`HandoffReader` is what a decode worker reads a handoff through:
the nearest replica the cluster directory knows first, then the node the prefill worker
wrote to (its blocks may not have reached the directory's watch yet).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.blockstore import GuardedStore, LayerWriter
from kvstore import Namespace
from kvstore.errors import KVStoreError

__all__ = ["HandoffReader"]

log = logging.getLogger(__name__)


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

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]:
        raise KVStoreError("a handoff reader does not write")

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter:
        raise KVStoreError("a handoff reader does not write")

    def remove(self, keys: Sequence[bytes]) -> int:
        raise KVStoreError("a handoff reader does not write")

    def close(self) -> None:
        """The stores belong to the worker; nothing to release here."""

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

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        """The whole batch from the cluster (one call), then what it missed from the
        source node (one more call): True for each block read, False for one neither
        has (whole blocks only)."""
        if layers is not None:
            raise KVStoreError("a handoff reader reads whole blocks")
        got: list[Any] = [False] * len(keys)
        if self.cluster is not None and keys:
            try:
                got = [r is True for r in self.cluster.batch_get_into(keys, outs)]
            except KVStoreError as exc:
                log.info("cluster read failed (%s); trying the source node", exc)
        self.from_cluster += sum(got)
        todo = [i for i, ok in enumerate(got) if not ok]
        if self.source is not None and todo:
            try:
                res = self.source.batch_get_into(
                    [keys[i] for i in todo], [outs[i] for i in todo], namespace=namespace
                )
            except KVStoreError:
                return got
            for i, r in zip(todo, res, strict=True):
                got[i] = r is True
                self.from_source += r is True
        return got
