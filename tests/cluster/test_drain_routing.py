"""Drain, hermetic: the directory record says ``draining`` before the node refuses
writes, a cluster client stops choosing a draining node for writes, the state
survives whatever order the server starts in, and an update the directory missed is
written once it answers again. The real thing (etcd, two
``kvstore serve`` processes, clients under load) is in tests/cluster/test_cluster_drain.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from kvstore.client.members import Members
from kvstore.config import ClientConfig, NodeConfig, ServerConfig
from kvstore.directory import MemoryBackend, MemoryDirectory, Mirror, NodeInfo
from kvstore.directory.mirror import PUT_NODE
from kvstore.errors import PermissionDenied, Unavailable
from kvstore.node.store import StoreNode
from kvstore.observe.counters import NodeCounters
from kvstore.server.gateway import Gateway
from kvstore.server.membership import Membership, node_record
from kvstore.tenants import Principal

T = TypeVar("T")
ADMIN = Principal("ops", admin=True)


def run(coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def node(node_id: str = "n1") -> StoreNode:
    return StoreNode(NodeConfig(node_id=node_id, dram_bytes=1 << 20, warm=False))


def drained(info: NodeInfo) -> NodeInfo:
    return dataclasses.replace(info, draining=True)


def put_nodes(m: Mirror, *infos: NodeInfo) -> None:
    m.apply([(PUT_NODE, i) for i in infos], m.revision + 1)


def test_write_order_skips_draining_nodes_and_reads_stay() -> None:
    m = Mirror()
    a, b = NodeInfo("a", "h", "h:1"), NodeInfo("b", "h", "h:2")
    put_nodes(m, a, drained(b))
    members = Members(m, ClientConfig(), NodeCounters(), node_id="b")
    assert members.write_order() == ["a"]  # the node asked for is draining: not chosen
    assert members.writer == "a"
    assert members.usable("b")  # still read from
    put_nodes(m, b)  # drain undone
    assert members.write_order() == ["b", "a"]
    put_nodes(m, drained(a), drained(b))
    assert members.write_order() == [] and members.writer is None


def test_gateway_announces_a_drain_before_refusing_writes() -> None:
    calls: list[tuple[bool, bool]] = []  # (announced value, local flag at that moment)

    async def body() -> None:
        with node() as n:
            gw = Gateway(n, ServerConfig(port=0, allow_anonymous=True))

            async def announce(draining: bool) -> None:
                calls.append((draining, gw.draining))

            gw.on_drain = announce
            assert await gw.set_draining(ADMIN, True) is True
            assert await gw.set_draining(ADMIN, False) is False
            assert calls == [(True, False), (False, False)]  # record first; writes first

            async def down(draining: bool) -> None:
                raise Unavailable("etcd is down")

            gw.on_drain = down
            with pytest.raises(Unavailable):
                await gw.set_draining(ADMIN, True)
            assert gw.draining  # the node drains anyway; the directory catches up
            with pytest.raises(PermissionDenied):
                await gw.set_draining(Principal("alpha"), False)
            assert gw.draining
            gw.close()

    run(body())


def test_membership_announces_draining_before_and_after_joining() -> None:
    backend = MemoryBackend()

    async def body() -> None:
        with node() as n:
            cfg = ServerConfig(port=0, allow_anonymous=True)
            info = node_record(n, cfg, 7400, 7401, "boot-1")
            member = Membership(n, cfg, info, MemoryDirectory(backend, "c"))
            reader = MemoryDirectory(backend, "c")
            await reader.open()
            m = await reader.mirror()
            await member.set_draining(True)  # before start: kept for the registration
            await member.start()
            assert m.node("n1") is not None and m.node("n1").draining  # type: ignore[union-attr]
            await member.set_draining(False)  # returns once the directory has it
            assert not m.node("n1").draining  # type: ignore[union-attr]
            assert member.registration is not None and not member.registration.draining
            await member.stop()
            await member.set_draining(True)  # after leaving: nothing to tell
            await reader.close()

        with node("solo") as n:  # standalone: nothing to announce, nothing fails
            cfg = ServerConfig(port=0, allow_anonymous=True)
            solo = Membership(n, cfg, node_record(n, cfg, 7400, 7401, "boot-2"))
            await solo.start()
            await solo.set_draining(True)
            assert solo.info.draining
            await solo.stop()

    try:
        run(body())
    finally:
        backend.close()


class _Flaky(MemoryDirectory):
    """The embedded directory with record updates failing while ``down`` is set."""

    down = False

    async def _update_node(self, info: NodeInfo, lease: int) -> int:
        if self.down:
            raise Unavailable("directory unreachable (injected)")
        return await super()._update_node(info, lease)


def test_an_update_the_directory_missed_is_written_by_the_keepalive() -> None:
    backend = MemoryBackend()

    async def body() -> None:
        async with _Flaky(backend, "c") as d, MemoryDirectory(backend, "c") as reader:
            m = await reader.mirror()
            await d.register_node(NodeInfo("n1", "h", "h:1"), ttl=1)
            d.down = True
            with pytest.raises(Unavailable):
                await d.update_node("n1", draining=True)
            assert d.registration("n1").draining  # kept as what the record should say
            assert not m.node("n1").draining  # type: ignore[union-attr]
            d.down = False
            deadline = asyncio.get_running_loop().time() + 3
            while not m.node("n1").draining:  # type: ignore[union-attr]
                assert asyncio.get_running_loop().time() < deadline, "never written"
                await asyncio.sleep(0.02)

    try:
        run(body())
    finally:
        backend.close()
