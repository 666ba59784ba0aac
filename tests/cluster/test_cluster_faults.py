"""A cluster client under injected faults, hermetic: real ClusterClient, Members and
NodeClients over the in-memory network (tests/support/memory_net.py), the embedded
directory wrapped in FaultyDirectory, transports wrapped in FaultyConnector. Whatever
fails, a read falls back to the next replica or reports a miss, never wrong bytes;
a directory that fails or stalls fails ``open`` within its timeout.
The same over etcd and processes: tests/cluster/test_cluster.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvstore import Namespace, prefix_keys
from kvstore.client.cluster import ClusterClient
from kvstore.client.faults import FaultyConnector
from kvstore.config import NodeConfig
from kvstore.directory import MemoryBackend, MemoryDirectory, NodeInfo
from kvstore.directory.background import BackgroundDirectory
from kvstore.directory.faults import FaultyDirectory
from kvstore.errors import TimeoutError_, TransportError, Unavailable
from kvstore.faults import Fault, FaultPlan
from kvstore.node.store import StoreNode
from kvstore.tenants import Principal
from tests.support.memory_net import TOKEN, MemoryNetwork, MemoryServer

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)
NODES = {"a": "node-a:7400", "b": "node-b:7400"}


def keys(n: int) -> list[bytes]:
    return list(prefix_keys(list(range(n * 16)), 16, NS))


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


@dataclass
class Cluster:
    net: MemoryNetwork
    backend: MemoryBackend
    registry: BackgroundDirectory

    def node(self, node_id: str) -> StoreNode:
        return self.net.server(NODES[node_id]).node

    def publish(self) -> None:
        """What each server's publisher does: its node's events into the directory."""
        for node_id in NODES:
            events = self.node(node_id).take_events()
            d = self.registry.directory
            assert d is not None
            rev = self.registry.call(lambda d=d, n=node_id, e=events: d.publish(n, e))
            self.registry.mirror.wait_for_revision_sync(rev, 5)  # type: ignore[union-attr]

    def client(self, plan: FaultPlan | None = None, **kw: object) -> ClusterClient:
        connector = self.net if plan is None else FaultyConnector(self.net, plan)
        kw.setdefault("directory", lambda: MemoryDirectory(self.backend, "c"))
        return ClusterClient(
            cluster="c",
            token=TOKEN,
            namespace=NS,
            connector=connector,
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    net, backend = MemoryNetwork(), MemoryBackend()
    registry = BackgroundDirectory(lambda: MemoryDirectory(backend, "c"))
    registry.start()
    for node_id, address in NODES.items():
        node = StoreNode(NodeConfig(node_id=node_id, dram_bytes=1 << 20, warm=False))
        net.add(MemoryServer(node, address))
        info = NodeInfo(node_id, address.partition(":")[0], address)
        d = registry.directory
        assert d is not None
        registry.call(lambda d=d, i=info: d.register_node(i))
    yield Cluster(net, backend, registry)
    registry.close()
    net.close()
    backend.close()


def replicate(c: Cluster, n: int) -> list[bytes]:
    """``n`` blocks stored on both nodes and published."""
    k = keys(n)
    scoped = Principal("default").scope_all(k)
    for node_id in NODES:
        node = c.node(node_id)
        for i, key in enumerate(scoped):
            node.put(key, block(i), namespace=Namespace(NS.model, NS.layout, "default"))
    c.publish()
    return k


def test_a_transport_cut_mid_batch_falls_back_to_the_other_replica(cluster: Cluster) -> None:
    k = replicate(cluster, 4)
    cut = Fault("read", after_keys=1, times=1, error=TransportError("reset (injected)"))
    with cluster.client(plan := FaultPlan(cut)).open() as cc:
        outs = [torch.zeros(SHAPE) for _ in k]
        assert cc.batch_get_into(k, outs) == [True] * 4
        assert all(torch.equal(o, block(i)) for i, o in enumerate(outs))
        assert plan.fired["read"] == 1
        assert cc.counters.snapshot()["fallbacks"] == 4  # the whole batch moved over


def test_per_key_errors_fall_back_key_by_key(cluster: Cluster) -> None:
    k = replicate(cluster, 4)
    plan = FaultPlan(Fault("read", after_keys=2, per_key=True, times=1))
    with cluster.client(plan).open() as cc:
        got = cc.batch_get(k)
        assert all(torch.equal(g, block(i)) for i, g in enumerate(got))
        assert cc.counters.snapshot()["fallbacks"] == 2  # only the keys that failed


def test_every_replica_failing_is_a_miss_or_an_error_never_bytes(cluster: Cluster) -> None:
    k = replicate(cluster, 2)
    plan = FaultPlan(Fault("read", after_keys=0, per_key=True, error=TransportError("x")))
    with cluster.client(plan).open() as cc:
        outs = [torch.zeros(SHAPE) for _ in k]
        res = cc.batch_get_into(k, outs)
        assert all(r is False or isinstance(r, TransportError) for r in res)
        assert not any(o.any() for o in outs)


def test_a_node_that_looks_down_gets_no_writes(cluster: Cluster) -> None:
    k = keys(3)
    plan = FaultPlan(Fault("reachable", where="node-a"), Fault("lend", where="node-a"))
    with cluster.client(plan, node_id="a").open() as cc:
        assert cc.batch_put(k, [block(i) for i in range(3)]) == [True] * 3
        assert cc.members.writer == "b"
        scoped = Principal("default").scope_all(k)
        assert cluster.node("b").exists(scoped) == [True] * 3
        assert cluster.node("a").exists(scoped) == [False] * 3


def test_a_failing_directory_fails_open(cluster: Cluster) -> None:
    plan = FaultPlan(Fault("directory.open", error=Unavailable("etcd down (injected)")))

    def directory() -> FaultyDirectory:
        return FaultyDirectory(MemoryDirectory(cluster.backend, "c"), plan)

    with pytest.raises(Unavailable):
        cluster.client(directory=directory).open()
    plan.clear()
    with cluster.client(directory=directory).open() as cc:  # healed: a fresh client works
        assert set(cc.nodes()) == {"a", "b"}


def test_a_stalled_directory_fails_open_within_its_timeout(cluster: Cluster) -> None:
    plan = FaultPlan(Fault("directory.mirror", delay_s=30))

    def directory() -> FaultyDirectory:
        return FaultyDirectory(MemoryDirectory(cluster.backend, "c"), plan)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError_):
        cluster.client(directory=directory, connect_timeout_s=0.3).open()
    assert time.monotonic() - t0 < 3
