"""A cluster client and sharded nodes, hermetic: real ClusterClient, Members and
NodeClients over the in-memory network (tests/support/memory_net.py), the embedded
directory holding a node ``g`` served by two shards (``g.s0``, ``g.s1``, registered as
``kvstore serve --shards 2`` registers them) beside a whole node ``a``.

A writer treats ``g`` as one node: each key goes to shard ``shard_of(stored key, 2)``, a down
shard's keys to the next node, a draining shard drains the group; readers find each
block on its shard through the directory. The same with real processes and etcd:
tests/cluster/test_cluster_shards.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvstore import Namespace, prefix_keys
from kvstore.client.cluster import ClusterClient
from kvstore.client.groups import WriteUnit, unit_prefix, write_units
from kvstore.client.parted_layers import PartedLayeredPut
from kvstore.config import NodeConfig
from kvstore.directory import MemoryBackend, MemoryDirectory, NodeInfo, Replica
from kvstore.directory.background import BackgroundDirectory
from kvstore.errors import InvalidValue, KVStoreError
from kvstore.node.store import StoreNode
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from kvstore.wire.shards import shard_of
from tests.support.memory_net import TOKEN, MemoryNetwork, MemoryServer

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)
SCOPE = Principal("default")
ADDRESSES = {"g.s0": "node-g0:7400", "g.s1": "node-g1:7400", "a": "node-a:7400"}


def records() -> list[NodeInfo]:
    """``g``'s shards and ``a``, as their servers register them."""
    out = []
    for node_id, address in ADDRESSES.items():
        info = NodeInfo(node_id, address.partition(":")[0], address)
        if node_id.startswith("g."):
            info = dataclasses.replace(info, group="g", shard=int(node_id[-1]), shards=2)
        out.append(info)
    return out


def home(key: bytes) -> int:
    """The shard of ``g`` that holds ``key``: placement is by the stored (scoped) key."""
    return shard_of(SCOPE.scope(key), 2)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return list(prefix_keys([seed] * 3 + list(range(n * 16)), 16, NS))[:n]


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


@dataclass
class Cluster:
    net: MemoryNetwork
    backend: MemoryBackend
    registry: BackgroundDirectory
    nodes: dict[str, StoreNode]

    def node(self, node_id: str) -> StoreNode:
        return self.nodes[node_id]

    def holders(self, k: bytes) -> set[str]:
        """The nodes whose store holds ``k`` (asked directly, not the directory)."""
        scoped = SCOPE.scope(k)
        return {n for n in ADDRESSES if self.node(n).exists([scoped]) == [True]}

    def register(self, *infos: NodeInfo) -> None:
        d = self.registry.directory
        assert d is not None
        for info in infos:
            self.registry.call(lambda d=d, i=info: d.register_node(i))

    def drain(self, node_id: str) -> None:
        """What ``kvstore drain`` makes a node do: mark its record draining."""
        d = self.registry.directory
        assert d is not None
        rev = self.registry.call(lambda: d.update_node(node_id, draining=True))
        self.registry.mirror.wait_for_revision_sync(rev, 5)  # type: ignore[union-attr]

    def publish(self) -> None:
        """What each server's publisher does: its node's events into the directory."""
        d = self.registry.directory
        assert d is not None
        for node_id in ADDRESSES:
            events = self.node(node_id).take_events()
            rev = self.registry.call(lambda d=d, n=node_id, e=events: d.publish(n, e))
            self.registry.mirror.wait_for_revision_sync(rev, 5)  # type: ignore[union-attr]

    def client(self, **kw: object) -> ClusterClient:
        return ClusterClient(
            cluster="c",
            token=TOKEN,
            namespace=NS,
            connector=self.net,
            directory=lambda: MemoryDirectory(self.backend, "c"),
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    net, backend = MemoryNetwork(), MemoryBackend()
    registry = BackgroundDirectory(lambda: MemoryDirectory(backend, "c"))
    registry.start()
    nodes = {}
    for node_id, address in ADDRESSES.items():
        nodes[node_id] = StoreNode(NodeConfig(node_id=node_id, dram_bytes=2 << 20, warm=False))
        net.add(MemoryServer(nodes[node_id], address))
    c = Cluster(net, backend, registry, nodes)
    c.register(*records())
    yield c
    registry.close()
    net.close()
    backend.close()


def test_each_key_goes_to_the_shard_shard_of_names_and_reads_find_it(cluster: Cluster) -> None:
    k = keys(24)
    with cluster.client(node_id="g").open() as w:
        assert w.members.write_order() == ["g", "a"]
        assert w.batch_put(k, [block(i) for i in range(24)]) == [True] * 24
        assert w.members.writer == "g"
        assert w.exists(k) == [True] * 24  # its own puts, before the directory lists them
    expected = [f"g.s{home(key)}" for key in k]
    assert {"g.s0", "g.s1"} <= set(expected)  # both shards took keys
    assert [cluster.holders(key) for key in k] == [{n} for n in expected]
    cluster.publish()
    with cluster.client(node_id="a").open() as r:  # another client, writing elsewhere
        listed = [{p.node_id for p in reps} for reps in r.mirror.lookup(SCOPE.scope_all(k))]
        assert listed == [{n} for n in expected]
        got = r.batch_get(k)
        assert all(torch.equal(g, block(i)) for i, g in enumerate(got))
        outs = [torch.zeros(SHAPE) for _ in k]
        assert r.batch_get_into(k, outs) == [True] * 24
        assert all(torch.equal(o, block(i)) for i, o in enumerate(outs))
        served = r.counters.snapshot()
        assert served["served.g.s0"] + served["served.g.s1"] == 48
        assert r.longest_prefix(k) == {"g": 24}  # one node, whichever shard holds a block


def test_a_shard_named_as_node_id_picks_its_group(cluster: Cluster) -> None:
    k = keys(8, seed=1)
    with cluster.client(node_id="g.s1").open() as w:
        assert w.members.write_order() == ["g", "a"]
        assert w.batch_put(k, [block(i) for i in range(8)]) == [True] * 8
    assert [cluster.holders(key) for key in k] == [{f"g.s{home(key)}"} for key in k]


def test_a_down_shard_passes_its_keys_to_the_next_node(cluster: Cluster) -> None:
    k = keys(24, seed=2)
    cluster.net.stop(ADDRESSES["g.s1"])
    with cluster.client(node_id="g").open() as w:
        assert w.batch_put(k, [block(i) for i in range(24)]) == [True] * 24
        assert w.members.writer == "g"  # shard 0 still takes its keys
        assert "g.s1" in w.members.suspects()
        got = w.batch_get(k)  # read back through its own puts' memory
        assert all(torch.equal(g, block(i)) for i, g in enumerate(got))
    for key in k:
        assert cluster.holders(key) == ({"g.s0"} if home(key) == 0 else {"a"})


def test_a_draining_shard_drains_its_group_for_writes(cluster: Cluster) -> None:
    cluster.drain("g.s1")
    k = keys(6, seed=3)
    with cluster.client(node_id="g").open() as w:
        assert w.members.write_order() == ["a"]
        assert w.batch_put(k, [block(i) for i in range(6)]) == [True] * 6
        assert w.members.writer == "a"
    assert all(cluster.holders(key) == {"a"} for key in k)


def test_a_layered_write_is_split_by_shard_and_commits_in_key_order(cluster: Cluster) -> None:
    k = keys(10, seed=4)
    blocks = [block(100 + i) for i in range(10)]
    with cluster.client(node_id="g").open() as w:
        with w.begin_layers(k, shape=SHAPE, dtype=torch.float32) as lw:
            assert isinstance(lw, PartedLayeredPut) and lw.keys == k
            lw.write(0, [b[0:1] for b in blocks])
            lw.write_stacked(1, torch.stack([b[1:2] for b in blocks], dim=1))
            assert lw.written == 2
            keep = [i != 3 for i in range(10)]
            res = lw.commit(keep)
        assert res == [None if i == 3 else True for i in range(10)]
        bad = w.begin_layers(k, shape=SHAPE, dtype=torch.float32)
        with bad, pytest.raises(InvalidValue):
            bad.write(0, [b[0:1] for b in blocks[:9]])  # one value short: nothing sent
        assert bad.done  # left without a commit: aborted on every shard
        got = w.batch_get(k)
        assert got[3] is None
        assert all(torch.equal(got[i], blocks[i]) for i in range(10) if i != 3)
    for i, key in enumerate(k):
        assert cluster.holders(key) == (set() if i == 3 else {f"g.s{home(key)}"})


def test_a_shard_failing_mid_write_fails_its_keys_and_keeps_the_rest(cluster: Cluster) -> None:
    k = keys(10, seed=8)
    on1 = [home(key) == 1 for key in k]
    assert any(on1) and not all(on1)
    blocks = [block(300 + i) for i in range(10)]
    with cluster.client(node_id="g").open() as w:
        lw = w.begin_layers(k, shape=SHAPE, dtype=torch.float32)
        lw.write(0, [b[0:1] for b in blocks])
        cluster.net.stop(ADDRESSES["g.s1"])  # its link breaks on the next layer
        lw.write(1, [b[1:2] for b in blocks])  # shard 0's part goes on
        res = lw.commit()
        cluster.net.start(ADDRESSES["g.s1"])
        assert [isinstance(r, KVStoreError) for r in res] == on1
        assert [r is True for r in res] == [not x for x in on1]
        got = w.batch_get([key for key, x in zip(k, on1, strict=True) if not x])
        kept = [b for b, x in zip(blocks, on1, strict=True) if not x]
        assert all(torch.equal(g, b) for g, b in zip(got, kept, strict=True))
    assert [cluster.holders(key) for key in k] == [set() if x else {"g.s0"} for x in on1]


def test_a_layered_write_on_a_whole_node_is_one_plain_write(cluster: Cluster) -> None:
    k = keys(3, seed=5)
    with cluster.client(node_id="a").open() as w:
        lw = w.begin_layers(k, shape=SHAPE, dtype=torch.float32)
        assert not isinstance(lw, PartedLayeredPut)  # the unsharded path is unchanged
        lw.write(0, [block(i) for i in range(3)])
        assert lw.commit() == [True] * 3


def test_the_async_client_writes_layers_split_by_shard(cluster: Cluster) -> None:
    from kvstore import AsyncStoreClient

    k = keys(6, seed=7)
    blocks = [block(200 + i) for i in range(6)]

    async def body() -> list[object]:
        c = await AsyncStoreClient.from_etcd(
            cluster="c",
            token=TOKEN,
            namespace=NS,
            node_id="g",
            connector=cluster.net,
            directory=lambda: MemoryDirectory(cluster.backend, "c"),
        )
        try:
            async with await c.begin_layers(k, shape=SHAPE, dtype=torch.float32) as lw:
                assert isinstance(lw.sync, PartedLayeredPut)
                await lw.write(0, blocks)
                return await lw.commit()
        finally:
            await c.close()

    assert asyncio.run(asyncio.wait_for(body(), 30)) == [True] * 6
    assert [cluster.holders(key) for key in k] == [{f"g.s{home(key)}"} for key in k]


def test_write_units_fold_shards_and_refuse_a_disputed_count() -> None:
    nodes = {r.node_id: r for r in records()}
    units = write_units(nodes)
    assert units["g"] == WriteUnit("g", ("g.s0", "g.s1"))
    assert units["a"] == WriteUnit("a", ("a",)) and not units["a"].sharded
    del nodes["g.s1"]  # shard 1's lease ran out: its keys have nowhere on g to go
    assert write_units(nodes)["g"].shards == ("g.s0", "")
    nodes["g.s1"] = dataclasses.replace(records()[1], shards=3)  # restarted as 3 shards
    skipped: list[str] = []
    assert "g" not in write_units(nodes, skipped) and skipped == ["g"]


def test_split_places_keys_by_shard_of_and_holds_back_unusable_shards() -> None:
    unit = WriteUnit("g", ("g.s0", "", "g.s2"))
    ks = keys(30, seed=6)
    placed, rest = unit.split(ks, range(30), lambda n: n != "g.s2")
    assert placed == {"g.s0": [i for i in range(30) if shard_of(ks[i], 3) == 0]}
    assert rest == [i for i in range(30) if shard_of(ks[i], 3) != 0]
    whole = WriteUnit("a", ("a",))
    assert whole.split(ks, [4, 2], lambda n: True) == ({"a": [4, 2]}, [])
    assert whole.split(ks, [4, 2], lambda n: False) == ({}, [4, 2])


def test_unit_prefix_counts_a_group_as_one_node() -> None:
    names = {"g.s0": "g", "g.s1": "g", "a": "a"}
    s0, s1, a = (Replica(n, TierKind.DRAM, 10) for n in ("g.s0", "g.s1", "a"))
    lookup = [(s0, a), (s1, a), (s1,), (s0,), (), (s0,)]
    assert unit_prefix(lookup, names) == {"a": 2, "g": 4}
    assert unit_prefix([(Replica("gone", TierKind.DRAM, 1),)], names) == {}
    assert unit_prefix([], names) == {}


def test_the_routers_prefix_view_counts_a_sharded_node_as_one(cluster: Cluster) -> None:
    """The router (engine/serving/placement.py) credits a worker beside ``g`` with the
    whole prefix its shards hold between them, at their tiers: counted per shard, the
    run would stop at the first block the other shard took."""
    from engine.serving.placement import PrefixView

    k = keys(12)
    with cluster.client(node_id="g").open() as w:
        assert w.batch_put(k, [block(i) for i in range(12)]) == [True] * 12
    cluster.publish()
    with cluster.client(node_id="a").open() as r:
        runs = PrefixView(r).runs(k)
        assert runs == {"g": [(TierKind.DRAM, 12)]}
        assert PrefixView(r).runs(k[:1] + keys(3, seed=9)) == {"g": [(TierKind.DRAM, 1)]}
