"""Membership of a serving node, hermetic: the embedded directory instead of etcd.

A standalone server drains its node's events (nobody else would); a clustered one
registers, publishes and leaves; a second claim on a live id fails fast naming the
holder, while a claim on a dead life's id waits out its lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvstore.config import NodeConfig, ServerConfig, resolve_config
from kvstore.directory import MemoryBackend, MemoryDirectory
from kvstore.directory.etcd_process import free_port
from kvstore.errors import ConfigError, ConflictError
from kvstore.node.store import StoreNode
from kvstore.server.membership import Membership, advertised_host, node_record
from kvstore.server.serve import StoreServer
from kvstore.tier_kinds import TierKind

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


def node(node_id: str = "n1") -> StoreNode:
    return StoreNode(NodeConfig(node_id=node_id, dram_bytes=1 << 20, warm=False))


def server_config(**kw: Any) -> ServerConfig:
    return ServerConfig(port=0, allow_anonymous=True, **kw)


def test_standalone_server_drains_node_events() -> None:
    async def body() -> None:
        srv = StoreServer(NodeConfig(dram_bytes=1 << 20, warm=False), server_config())
        await srv.start()
        try:
            assert srv.node is not None and srv.membership is not None
            assert not srv.membership.clustered
            for _ in range(50):
                srv.node.put(os.urandom(16), b"x" * 100)
            assert len(srv.node.events) > 0
            await until(lambda: len(srv.node.events) == 0, 2, "events drained")  # type: ignore[union-attr]
        finally:
            await srv.stop()
        assert srv.membership is None

    run(body())


def test_clustered_node_registers_publishes_and_leaves() -> None:
    backend = MemoryBackend()

    async def body() -> None:
        with node() as n:
            info = node_record(n, server_config(), 7400, 7401, "boot-1")
            assert info.tiers == {TierKind.DRAM: 1 << 20} and info.data_address.endswith(":7401")
            member = Membership(n, server_config(), info, MemoryDirectory(backend, "c"))
            reader = MemoryDirectory(backend, "c")
            await reader.open()
            m = await reader.mirror()
            await member.start()
            assert member.registration is not None and m.node("n1") is not None
            key = os.urandom(16)
            n.put(key, b"y" * 64)
            await until(lambda: bool(m.replicas(key)), 2, "block published")
            await member.stop()
            assert m.node("n1") is None and not m.replicas(key)  # revoked at once
            await reader.close()

    try:
        run(body())
    finally:
        backend.close()


def test_live_holder_is_refused_fast_and_dead_one_waited_out() -> None:
    backend = MemoryBackend()
    listener = socket.create_server(("127.0.0.1", 0))  # the live holder "answers" here
    live_addr = f"127.0.0.1:{listener.getsockname()[1]}"
    cfg = server_config(node_lease_ttl_s=1.0)

    async def body() -> None:
        with node() as n1, node() as n2:
            info = dataclasses.replace(node_record(n1, cfg, 1, 2, "b1"), address=live_addr)
            first = Membership(n1, cfg, info, MemoryDirectory(backend))
            await first.start()
            second_info = node_record(n2, cfg, free_port(), 2, "b2")
            second = Membership(n2, cfg, second_info, MemoryDirectory(backend))
            t0 = time.monotonic()
            with pytest.raises(
                ConflictError, match=f"already served by a live node at {live_addr}"
            ):
                await second.start()
            assert time.monotonic() - t0 < 1.0
            await first.stop(deregister=False)  # a crash: the lease is left to expire
            listener.close()
            third = Membership(n2, cfg, second_info, MemoryDirectory(backend))
            t0 = time.monotonic()
            await third.start()
            assert 0.3 < time.monotonic() - t0 < cfg.node_lease_ttl_s + 1.5
            await third.stop()

    try:
        run(body())
    finally:
        listener.close()
        backend.close()


def test_cluster_settings_are_validated(tmp_path: Path) -> None:
    assert server_config().etcd == "" and server_config().node_lease_ttl_s == 10.0
    env = {"KVSTORE_ETCD": "etcd:2379", "KVSTORE_CLUSTER": "prod", "KVSTORE_ALLOW_ANONYMOUS": "1"}
    cfg = resolve_config(ServerConfig, env=env)
    assert (cfg.etcd, cfg.cluster) == ("etcd:2379", "prod")
    for bad, msg in (
        ({"etcd": "no-port"}, "etcd"),
        ({"etcd": "h:1", "cluster": "a/b"}, "cluster"),
        ({"node_lease_ttl_s": 0}, "node_lease_ttl_s"),
    ):
        with pytest.raises(ConfigError, match=msg):
            server_config(**bad)
    assert advertised_host(server_config(host="0.0.0.0")) == socket.getfqdn()
    assert advertised_host(server_config(advertise_host="n1.example")) == "n1.example"
