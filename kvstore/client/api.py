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
node each call costs one attribute check more than NodeClient's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client.cluster import ClusterClient
from kvstore.client.layered import LayeredPut
from kvstore.client.sharded import ShardedClient
from kvstore.client.store import AsyncNodeClient, NodeClient
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

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
        shard other than 0 lists none and is served as the node it registers as.)"""
        info = self._info
        if self.whole_node and info.shard_count > 1 and info.shards:
            self._sharded = ShardedClient(self, info)

    def close(self) -> None:
        """Close every shard's connections (a sharded node) and this one's; idempotent."""
        if self._sharded is not None:
            self._sharded.close()
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

    def wait_prefaulted(self, timeout: float | None = 30.0) -> bool:
        if self._sharded is not None:
            self._check_open()
            return self._sharded.wait_prefaulted(timeout)
        return super().wait_prefaulted(timeout)

    # -- data ----------------------------------------------------------------------------

    def put(
        self,
        key: bytes,
        value: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> bool:
        if self._sharded is not None:
            return self._sharded.put(key, value, namespace=namespace, timeout=timeout)
        return super().put(key, value, namespace=namespace, timeout=timeout)

    def get(
        self, key: bytes, *, namespace: Namespace | None = None, timeout: float | None = None
    ) -> Any:
        if self._sharded is not None:
            return self._sharded.get(key, namespace=namespace, timeout=timeout)
        return super().get(key, namespace=namespace, timeout=timeout)

    def get_into(
        self,
        key: bytes,
        out: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        if self._sharded is not None:
            return self._sharded.get_into(
                key, out, namespace=namespace, timeout=timeout, layers=layers
            )
        return super().get_into(key, out, namespace=namespace, timeout=timeout, layers=layers)

    def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[bool | KVStoreError]:
        if self._sharded is not None:
            return self._sharded.batch_put(keys, values, namespace=namespace, timeout=timeout)
        return super().batch_put(keys, values, namespace=namespace, timeout=timeout)

    def begin_layers(
        self,
        keys: Sequence[bytes],
        *,
        shape: Sequence[int],
        dtype: Any,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> LayeredPut:
        kw: dict[str, Any] = {"namespace": namespace, "timeout": timeout}
        if self._sharded is not None:
            return self._sharded.begin_layers(keys, shape=shape, dtype=dtype, **kw)
        return super().begin_layers(keys, shape=shape, dtype=dtype, **kw)

    def batch_get(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if self._sharded is not None:
            return self._sharded.batch_get(keys, namespace=namespace, timeout=timeout)
        return super().batch_get(keys, namespace=namespace, timeout=timeout)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[bool | KVStoreError]:
        kw: dict[str, Any] = {"namespace": namespace, "timeout": timeout, "layers": layers}
        if self._sharded is not None:
            return self._sharded.batch_get_into(keys, outs, **kw)
        return super().batch_get_into(keys, outs, **kw)

    # -- metadata -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        if self._sharded is not None:
            return self._sharded.exists(keys, timeout=timeout)
        return super().exists(keys, timeout=timeout)

    def match_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        if self._sharded is not None:
            return self._sharded.match_prefix(keys, timeout=timeout)
        return super().match_prefix(keys, timeout=timeout)

    def remove(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        if self._sharded is not None:
            return self._sharded.remove(keys, timeout=timeout)
        return super().remove(keys, timeout=timeout)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Node stats; a sharded node's summed over its shards, each shard's own under
        ``"shards"`` (kvstore/client/sharded.py)."""
        if self._sharded is not None:
            return self._sharded.stats(timeout=timeout)
        return super().stats(timeout=timeout)

    def health(self, *, timeout: float | None = None) -> str:
        if self._sharded is not None:
            return self._sharded.health(timeout=timeout)
        return super().health(timeout=timeout)

    def set_draining(self, draining: bool = True, *, timeout: float | None = None) -> bool:
        if self._sharded is not None:
            return self._sharded.set_draining(draining, timeout=timeout)
        return super().set_draining(draining, timeout=timeout)

    def control(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """One control-plane RPC by name; on a sharded node answered for the whole node
        (kvstore/client/sharded_control.py says what goes where)."""
        if self._sharded is not None:
            return self._sharded.control(method, request, timeout=timeout)
        return super().control(method, request, timeout=timeout)


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
