"""The SDK's two public classes: a client of one node, which also opens clients of a
whole cluster.

:class:`StoreClient` is a :class:`~kvstore.client.store.NodeClient` (one ``kvstore
serve``, see store.py) plus :meth:`StoreClient.from_etcd`, which returns a
:class:`~kvstore.client.cluster.ClusterClient` with the same methods. They live here,
above both, so that the cluster client (which holds one NodeClient per member) and the
single-node client never import each other.
"""

from __future__ import annotations

from typing import Any

from kvstore.client.cluster import ClusterClient
from kvstore.client.store import AsyncNodeClient, NodeClient

__all__ = ["AsyncStoreClient", "StoreClient"]


class StoreClient(NodeClient):
    """Blocking client of one node (``connect``) or of a cluster (``from_etcd``)."""

    @classmethod
    def from_etcd(
        cls, endpoint: str = "127.0.0.1:2379", *, cluster: str = "default", **kwargs: Any
    ) -> ClusterClient:
        """An open client of a whole cluster, found through its etcd directory: puts go
        to one chosen node (a local one first), gets to the nearest replica with
        fallback to the next. Same methods as this class; see kvstore/client/cluster.py.
        Keyword arguments: those of the constructor, plus ``node_id`` (the node to write
        to while it lives)."""
        return ClusterClient(endpoint, cluster, **kwargs).open()


class AsyncStoreClient(AsyncNodeClient):
    """asyncio client of one node (``connect``) or of a cluster (``from_etcd``)."""

    @classmethod
    async def from_etcd(
        cls, endpoint: str = "127.0.0.1:2379", *, cluster: str = "default", **kwargs: Any
    ) -> AsyncStoreClient:
        """An open asyncio client of a whole cluster found through etcd (the async face
        of :meth:`StoreClient.from_etcd`; data calls take no ``namespace=`` there)."""
        self = cls.__new__(cls)
        self._wrap(ClusterClient(endpoint, cluster, **kwargs))
        try:
            await self._run(self.sync.open, check=False)
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        return self
