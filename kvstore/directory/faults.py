"""A Directory that delegates to a real one and fails or stalls calls as a
:class:`~kvstore.faults.FaultPlan` says (STYLE habit 11).

Give ``lambda: FaultyDirectory(MemoryDirectory(backend, "c"), plan)`` to a cluster
client as ``directory=`` (or wrap an EtcdDirectory the same way). Operation names are
``directory.<method>`` (``directory.open``, ``directory.mirror``,
``directory.list_nodes``, ``directory.publish``, ...); ``where`` is the cluster name.
A stall sleeps on the directory's own loop, as a slow etcd would keep it waiting.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstore.directory.base import DEFAULT_TTL, BlockSnapshot, Directory, NodeInfo
from kvstore.directory.mirror import Mirror
from kvstore.events import BlockEvent
from kvstore.faults import FaultPlan

__all__ = ["FaultyDirectory"]


class FaultyDirectory(Directory):
    def __init__(self, inner: Directory, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.cluster = inner.cluster

    async def _fault(self, method: str) -> None:
        await self.plan.ainject(f"directory.{method}", self.cluster)

    async def open(self) -> None:
        await self._fault("open")
        await self.inner.open()

    async def close(self, *, deregister: bool = True) -> None:
        await self.inner.close(deregister=deregister)  # closing always works

    async def register_node(
        self, info: NodeInfo, *, ttl: float = DEFAULT_TTL, wait: float = 0.0
    ) -> NodeInfo:
        await self._fault("register_node")
        return await self.inner.register_node(info, ttl=ttl, wait=wait)

    async def update_node(self, node_id: str, **changes: Any) -> int:
        await self._fault("update_node")
        return await self.inner.update_node(node_id, **changes)

    async def deregister(self, node_id: str) -> None:
        await self._fault("deregister")
        await self.inner.deregister(node_id)

    async def publish(self, node_id: str, events: Iterable[BlockEvent]) -> int:
        await self._fault("publish")
        return await self.inner.publish(node_id, events)

    async def sync(self, node_id: str, blocks: BlockSnapshot) -> int:
        await self._fault("sync")
        return await self.inner.sync(node_id, blocks)

    async def flush(self, node_id: str) -> int:
        await self._fault("flush")
        return await self.inner.flush(node_id)

    def pending(self, node_id: str) -> int:
        return self.inner.pending(node_id)

    def registration(self, node_id: str) -> NodeInfo:
        return self.inner.registration(node_id)

    async def list_nodes(self) -> list[NodeInfo]:
        await self._fault("list_nodes")
        return await self.inner.list_nodes()

    async def mirror(self) -> Mirror:
        await self._fault("mirror")
        return await self.inner.mirror()
