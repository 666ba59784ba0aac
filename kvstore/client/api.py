"""The SDK's two public classes: a client of one node, which also opens clients of a
whole cluster.

:class:`StoreClient` is a :class:`~kvstore.client.store.NodeClient` (one ``kvstore
serve``, see store.py) plus :meth:`StoreClient.from_etcd`, which returns a
:class:`~kvstore.client.cluster.ClusterClient` with the same methods. They live here,
above both, so that the cluster client (which holds one NodeClient per member) and the
single-node client never import each other.

A node served by several processes (``kvstore serve --shards N``) is one node to a
StoreClient: when the server it dials says, at connect time, that it is shard 0 of N,
the client's calls go to a :class:`~kvstore.client.sharded.ShardedClient`, which sends
each key straight to its shard (see sharded.py for what goes where). Against a whole
node every call is NodeClient's own.
"""

from __future__ import annotations

from typing import Any

from kvstore.client.cluster import ClusterClient
from kvstore.client.sharded import ShardedClient
from kvstore.client.store import AsyncNodeClient, NodeClient

__all__ = ["AsyncStoreClient", "StoreClient"]


class StoreClient(NodeClient):
    """Blocking client of one node (``connect``) or of a cluster (``from_etcd``).

    ``whole_node=False``: talk to the dialled server alone even when it is shard 0 of a
    sharded node (tooling that walks the directory, where each shard is a node)."""

    _sharded: ShardedClient | None = None

    def __init__(self, address: str, *, whole_node: bool = True, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.whole_node = whole_node

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

    def _opened(self) -> None:
        """A sharded node's shard 0 lists its shards: from now on calls go by shard. (A
        shard other than 0 lists none and is served as the node it registers as.)

        The sharded client's methods are bound over this instance's, so a call on a
        whole node runs NodeClient's own with no check or frame added (the 1 MiB
        shared-memory get is ~45 us: a layer of Python per call shows)."""
        info = self._info
        if self.whole_node and info.shard_count > 1 and info.shards:
            sharded = self._sharded = ShardedClient(self, info)
            for name in _BY_SHARD:
                setattr(self, name, getattr(sharded, name))

    def close(self) -> None:
        """Close every shard's connections (a sharded node) and this one's; idempotent.
        Calls after it reach NodeClient's methods, which say the client is closed."""
        if self._sharded is not None:
            self._sharded.close()
            for name in _BY_SHARD:
                self.__dict__.pop(name, None)
        super().close()

    @property
    def shards(self) -> int:
        """How many shards this client sends keys to (1: a whole node)."""
        return self._sharded.count if self._sharded is not None else 1

    @property
    def transport(self) -> str:
        """The transport of the latest data connection (``shm`` or ``tcp``; "" before one)."""
        if self._sharded is not None:
            return self._sharded.transport
        return super().transport


_BY_SHARD = (
    "put",
    "get",
    "get_into",
    "batch_put",
    "begin_layers",
    "batch_get",
    "batch_get_into",
    "exists",
    "match_prefix",
    "remove",
    "stats",
    "health",
    "set_draining",
    "control",
    "wait_prefaulted",
)
"""The calls a sharded node answers through ShardedClient (same names, same signatures)."""


class AsyncStoreClient(AsyncNodeClient):
    """asyncio client of one node (``connect``) or of a cluster (``from_etcd``); a
    sharded node is one node to it, as to :class:`StoreClient`, which it runs."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._wrap(StoreClient(address, **kwargs))

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
