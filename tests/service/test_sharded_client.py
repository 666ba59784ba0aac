"""A StoreClient against a sharded node (issue 32): ``StoreClient.connect`` on shard 0's
address sees one node, and each key goes straight to shard ``shard_of(stored key, N)``
(the key scoped by the caller's tenant).

The node is the shards ``kvstore serve --shards N`` runs, as StoreServer objects in this
process (tests/support/sharded_node.py), so these run in the hermetic suite; the last
test runs the real command. What is checked: keys spread over the shards and each lives
on its own shard; every call round-trips bytes exactly and answers in the caller's
order; a stopped shard fails only its own keys; tenants stay apart; a tenant's quota
bounds what it holds on the node as a whole.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import AsyncStoreClient, Namespace, StoreClient, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore.client.admin import AdminClient
from kvstore.client.drain import drain_node
from kvstore.client.sharded import ShardedClient
from kvstore.client.store import NodeClient
from kvstore.errors import ClosedError, ConflictError, KVStoreError, TimeoutError_, Unavailable
from kvstore.wire.shards import shard_of
from tests.support.server_process import (
    ADMIN,
    ALPHA,
    BRAVO,
    ServerProcess,
    base_flags,
    principal_of,
)
from tests.support.sharded_node import ShardedFactory, ShardedNode
from tests.support.waiting import wait_until

SHAPE = (4, 2, 2, 16, 8)  # layers, K/V, heads, tokens, head dim: 4 KiB of float16


def home(key: bytes, count: int = 2) -> int:
    """The shard ALPHA's ``key`` lives on: placement is by the stored (scoped) key."""
    return shard_of(principal_of(ALPHA).scope(key), count)


def fresh(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def spread(n: int, count: int = 2) -> list[bytes]:
    """Random keys where key i lands on shard i % count, so any ``count`` of them in a
    row span the shards (eight random keys all on one of two shards is 1 in 128)."""
    keys: list[bytes] = []
    while len(keys) < n:
        key = os.urandom(16)
        if home(key, count) == len(keys) % count:
            keys.append(key)
    return keys


def values(n: int, seed: int) -> list[np.ndarray]:
    """Distinct arrays of different sizes, so a value landing at another key shows."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 1000 + 37 * i, dtype=np.uint8) for i in range(n)]


def on_both(keys: list[bytes], count: int = 2) -> None:
    """The test's keys really span the shards (else it would prove nothing)."""
    assert {home(k, count) for k in keys} == set(range(count))


@pytest.fixture(scope="module")
def client(sharded_node: ShardedNode) -> Iterator[StoreClient]:
    with sharded_node.client(ALPHA) as c:
        yield c


@pytest.fixture(scope="module")
def shard_clients(sharded_node: ShardedNode) -> Iterator[list[StoreClient]]:
    """A client of each shard alone (as tooling walking the directory sees them)."""
    clients = [
        StoreClient.connect(f"127.0.0.1:{port}", token=ALPHA.token, whole_node=False)
        for port, _ in sharded_node.ports
    ]
    yield clients
    for c in clients:
        c.close()


def test_each_key_lives_on_its_own_shard(
    sharded_node: ShardedNode, client: StoreClient, shard_clients: list[StoreClient]
) -> None:
    keys, vals = spread(48), values(48, 1)
    on_both(keys)
    before = [sharded_node.shard_blocks(i) for i in range(2)]
    assert client.shards == 2
    assert client.batch_put(keys, vals) == [True] * len(keys)
    for i, c in enumerate(shard_clients):
        assert c.shards == 1
        mine = [home(k, 2) == i for k in keys]
        assert c.exists(keys) == mine  # there, and only there
        assert sharded_node.shard_blocks(i) - before[i] == sum(mine) > 0
    per_shard = client.stats()["shards"]
    assert [s["node_id"] for s in per_shard] == ["sharded.s0", "sharded.s1"]
    assert all(s["blocks"] > 0 for s in per_shard)


def test_every_data_call_round_trips_bytes_in_order(client: StoreClient) -> None:
    keys, vals = spread(24), values(24, 2)
    on_both(keys)
    assert client.batch_put(keys, vals) == [True] * 24
    assert client.batch_put(keys[:3], vals[:3]) == [False] * 3  # stored already
    got = client.batch_get(keys + fresh(1))
    assert got[-1] is None
    assert all(np.array_equal(g, v) for g, v in zip(got, vals, strict=False))
    outs = [np.zeros_like(v) for v in vals]
    assert client.batch_get_into(keys, outs) == [True] * 24
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals, strict=True))
    for k, v in zip(keys[:6], vals[:6], strict=True):  # single-key calls on each shard
        assert np.array_equal(client.get(k), v)
        out = np.zeros_like(v)
        assert client.get_into(k, out) and np.array_equal(out, v)
    one, data = fresh(1)[0], b"raw bytes \x00\xff" * 100
    assert client.put(one, data) and client.get(one) == data
    assert client.batch_get([]) == [] and client.batch_put([], []) == []


def test_layer_ranges_come_from_each_keys_shard(client: StoreClient) -> None:
    keys = spread(8)
    on_both(keys)
    blocks = [np.random.default_rng(i).standard_normal(SHAPE).astype(np.float16) for i in range(8)]
    assert client.batch_put(keys, blocks) == [True] * 8
    outs = [np.zeros((2, *SHAPE[1:]), np.float16) for _ in keys]
    assert client.batch_get_into(keys, outs, layers=(1, 3)) == [True] * 8
    assert all(np.array_equal(o, b[1:3]) for o, b in zip(outs, blocks, strict=True))


def test_match_prefix_exists_and_remove_span_the_shards(client: StoreClient) -> None:
    ns = Namespace("sharded-model", "uint8:L1:H1:D1")
    keys = prefix_keys(list(range(16 * 12)), 16, ns)
    on_both(keys[:7])
    vals = values(7, 3)
    assert client.batch_put(keys[:7], vals) == [True] * 7
    assert client.match_prefix(keys) == 7
    assert client.exists(keys) == [True] * 7 + [False] * 5
    hole = next(i for i in range(1, 7) if home(keys[i], 2) != home(keys[0], 2))
    assert client.remove([keys[hole], fresh(1)[0]]) == 1
    assert client.match_prefix(keys) == hole  # cut on the other shard
    assert client.remove(keys) == 6 and client.match_prefix(keys) == 0
    assert client.control("MatchPrefix", pb.KeysRequest(keys=keys)).matched == 0


def test_a_layered_put_writes_each_shards_blocks(client: StoreClient) -> None:
    keys = spread(6)
    on_both(keys)
    blocks = [
        np.random.default_rng(10 + i).standard_normal(SHAPE).astype(np.float16) for i in range(6)
    ]
    with client.begin_layers(keys, shape=SHAPE, dtype=np.float16) as w:
        for layer in range(SHAPE[0]):
            w.write(layer, [b[layer : layer + 1] for b in blocks])
        assert client.exists(keys) == [False] * 6  # nothing before the commit
        keep = [i != 2 for i in range(6)]
        assert w.commit(keep) == [None if i == 2 else True for i in range(6)]
    got = client.batch_get(keys)
    assert got[2] is None
    assert all(np.array_equal(got[i], blocks[i]) for i in range(6) if i != 2)

    stacked_keys = fresh(5)
    stacked = np.stack(blocks[:5], axis=1)  # (layers, keys, ...): layer-major
    with client.begin_layers(stacked_keys, shape=SHAPE, dtype=np.float16) as w:
        w.write_stacked(0, stacked[:3])
        w.write_stacked(3, stacked[3:])
        assert w.commit() == [True] * 5
    assert all(
        np.array_equal(g, b) for g, b in zip(client.batch_get(stacked_keys), blocks, strict=False)
    )

    aborted = fresh(4)
    with client.begin_layers(aborted, shape=SHAPE, dtype=np.float16) as w:
        w.write(0, [b[:1] for b in blocks[:4]])
    assert client.exists(aborted) == [False] * 4  # left without a commit: nothing stored


def test_the_async_client_sees_one_node(sharded_node: ShardedNode) -> None:
    keys, vals = spread(16), values(16, 4)
    on_both(keys)

    async def body() -> None:
        async with AsyncStoreClient(sharded_node.address, token=ALPHA.token) as ac:
            assert ac.sync.shards == 2
            assert await ac.batch_put(keys, vals) == [True] * 16
            outs = [np.zeros_like(v) for v in vals]
            assert await ac.batch_get_into(keys, outs) == [True] * 16
            assert all(np.array_equal(o, v) for o, v in zip(outs, vals, strict=True))
            assert np.array_equal(await ac.get(keys[5]), vals[5])
            assert await ac.match_prefix(keys) == 16
            assert (await ac.stats())["node_id"] == "sharded"
            w = await ac.begin_layers(fresh(4), shape=SHAPE, dtype=np.float16)
            async with w:
                for layer in range(SHAPE[0]):
                    await w.write(layer, [np.ones((1, *SHAPE[1:]), np.float16)] * 4)
                assert await w.commit() == [True] * 4

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_closed_client_of_a_sharded_node_says_so(sharded_node: ShardedNode) -> None:
    c = StoreClient.connect(sharded_node.address, token=ALPHA.token)
    assert c.shards == 2 and c.put(fresh(1)[0], values(1, 7)[0])
    c.close()
    for call in (lambda: c.get(fresh(1)[0]), lambda: c.exists(fresh(2)), c.stats):
        with pytest.raises(ClosedError, match="closed"):
            call()


def test_stats_and_health_are_the_nodes(
    client: StoreClient, shard_clients: list[StoreClient]
) -> None:
    st = client.stats()
    own = [c.stats() for c in shard_clients]
    assert st["node_id"] == "sharded" and len(st["shards"]) == 2
    assert st["blocks"] == sum(s["blocks"] for s in own)
    dram = st["tiers"]["dram"]
    assert dram["capacity"] == sum(s["tiers"]["dram"]["capacity"] for s in own)
    assert client.health() == "serving"


def test_admin_calls_see_the_whole_node(sharded_factory: ShardedFactory) -> None:
    node = sharded_factory()  # its own: a scan lists only this test's blocks
    with node.client(ADMIN) as c:
        assert c.set_draining(True) and c.health() == "draining"
        assert _shard_health(node) == ["draining"] * 2
        assert not c.set_draining(False) and c.health() == "serving"
        keys = spread(20)
        on_both(keys)
        assert c.batch_put(keys, values(20, 5)) == [True] * 20
        tiers = c.control("Lookup", pb.KeysRequest(keys=[*keys, fresh(1)[0]])).tier
        assert list(tiers) == ["dram"] * 20 + [""]
        admin = AdminClient(c)
        listed = admin.scan(10_000)
        assert len(listed) == 20  # both shards'
        first, more = admin.scan_page(5)
        assert len(first) == 5 and more
        exported = admin.export([b.key for b in listed])
        assert all(r is not None for r in exported)
        plan = admin.evict("dram", 0, dry_run=True, list_limit=3)
        assert plan["moved"] == 20 and len(plan["blocks"]) == 3
        assert admin.purge([b.key for b in listed]) == 20
        assert c.exists(keys) == [False] * 20
        assert admin.import_blocks([r for r in exported if r is not None]) == [True] * 20
        assert len(admin.scan(10_000)) == 20
        assert admin.purge([b.key for b in listed]) == 20


def test_control_rpcs_answer_for_the_node(client: StoreClient) -> None:
    keys = spread(12)
    on_both(keys)
    assert client.batch_put(keys, values(12, 11)) == [True] * 12
    extra = fresh(1)
    present = client.control("Exists", pb.KeysRequest(keys=extra + keys)).present
    assert list(present) == [False] + [True] * 12
    stats = client.control("Stats", pb.StatsRequest())
    assert stats.node_id == "sharded" and stats.blocks == client.stats()["blocks"]
    assert client.control("Health", pb.HealthRequest()).status == pb.HealthResponse.SERVING
    assert client.control("Info", pb.InfoRequest()).shard_count == 2
    assert client.control("Remove", pb.KeysRequest(keys=keys + extra)).removed == 12


def test_a_drain_moves_a_sharded_node_into_another(sharded_factory: ShardedFactory) -> None:
    source, target = sharded_factory(group="source"), sharded_factory(group="target")
    keys = spread(20)
    on_both(keys)
    vals = values(20, 12)
    with source.client(ALPHA) as c:
        assert c.batch_put(keys, vals) == [True] * 20
    with source.client(ADMIN) as src, target.client(ADMIN) as dst:
        report = drain_node(src, [dst], page=7)
        assert (report.moved, report.dropped, report.remaining) == (20, 0, 0)
        assert src.health() == "draining" and src.stats()["blocks"] == 0
        assert [s["blocks"] for s in dst.stats()["shards"]] == [
            target.shard_blocks(0),
            target.shard_blocks(1),
        ]
        assert dst.stats()["blocks"] == 20
        assert target.shard_blocks(0) > 0 and target.shard_blocks(1) > 0
    # Each moved block sits where its owner's clients look: the owner finds every one
    # through the target's address, and each shard holds exactly its own keys.
    with target.client(ALPHA) as owner:
        got = owner.batch_get(keys)
        assert all(np.array_equal(g, v) for g, v in zip(got, vals, strict=True))
    for i, (port, _) in enumerate(target.ports):
        addr = f"127.0.0.1:{port}"
        with StoreClient.connect(addr, token=ALPHA.token, whole_node=False) as lone:
            assert lone.exists(keys) == [home(k) == i for k in keys]


def _shard_health(node: ShardedNode) -> list[str]:
    """Each shard's own health."""
    out = []
    for port, _ in node.ports:
        with StoreClient.connect(f"127.0.0.1:{port}", token=ADMIN.token, whole_node=False) as c:
            out.append(c.health())
    return out


def test_a_stopped_shard_fails_only_its_own_keys(sharded_factory: ShardedFactory) -> None:
    node = sharded_factory()
    keys, vals = spread(32), values(32, 6)
    on_both(keys)
    down = [home(k, 2) == 1 for k in keys]
    deadline = 8.0
    with node.client(ALPHA, retries=0, timeout_s=deadline, connect_timeout_s=deadline) as c:
        assert c.batch_put(keys, vals) == [True] * 32
        node.stop_shard(1)
        got = c.batch_get(keys)
        for g, v, lost in zip(got, vals, down, strict=True):
            assert isinstance(g, KVStoreError) if lost else np.array_equal(g, v)
        # Once it failed, the down shard is skipped: its keys fail without waiting out
        # the deadline (while it is suspect, and after, when the probe finds it closed).
        for _ in range(4):
            t0 = time.monotonic()
            got = c.batch_get(keys)
            assert time.monotonic() - t0 < deadline / 2
            assert [isinstance(g, Unavailable) for g in got] == down
            time.sleep(0.4)
        assert c.counters.get("shard_failures") >= 1 and c.counters.get("shard_skipped") >= 4
        more, more_vals = fresh(16), values(16, 7)
        put = c.batch_put(more, more_vals)
        assert [isinstance(r, KVStoreError) for r in put] == [home(k, 2) == 1 for k in more]
        assert c.exists(keys) == [not lost for lost in down]  # unreachable: absent
        assert c.match_prefix(keys) == down.index(True)
        with pytest.raises(KVStoreError):
            c.get(keys[down.index(True)])
        assert np.array_equal(c.get(keys[down.index(False)]), vals[down.index(False)])
        with pytest.raises(KVStoreError):  # a node-wide call needs every shard
            c.stats()

        node.start_shard(1)  # back on its ports, empty (its DRAM died with it)
        again = [k for k, lost in zip(keys, down, strict=True) if lost]
        pending = again

        def put_back() -> bool:  # skipped until the probe finds it; dead sockets drop
            nonlocal pending
            try:
                res = c.batch_put(pending, [b"back"] * len(pending))
            except Unavailable:  # its keys alone, every one skipped: the call raises
                return False
            assert not [r for r in res if r is False]
            pending = [k for k, r in zip(pending, res, strict=True) if r is not True]
            return not pending

        wait_until(put_back, "the restarted shard takes puts again", within=deadline)
        assert c.batch_get(again) == [b"back"] * len(again)


def test_a_shard_down_before_its_first_call_fails_at_once(
    sharded_factory: ShardedFactory,
) -> None:
    """A client opens a shard at its first call: when that shard is down then, the
    callers fail at once (a probe), not one connect timeout after another."""
    node = sharded_factory()
    connect = 5.0
    with node.client(ALPHA, retries=0, timeout_s=2.0, connect_timeout_s=connect) as c:
        node.stop_shard(1)
        key = next(k for k in spread(8) if home(k, 2) == 1)
        errors: list[BaseException] = []

        def get() -> None:
            try:
                c.get(key)
            except KVStoreError as exc:
                errors.append(exc)

        t0 = time.monotonic()
        threads = [threading.Thread(target=get) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * connect)
        assert time.monotonic() - t0 < connect / 2
        assert len(errors) == 4 and all(isinstance(e, Unavailable) for e in errors)

        node.start_shard(1)  # and once it is back, the client opens it

        def put() -> bool:
            try:
                return c.put(key, b"back") in (True, False)
            except Unavailable:
                return False

        wait_until(put, "the shard that was down at first use is opened", within=connect)
        assert c.get(key) == b"back"


def test_a_callers_short_timeout_leaves_the_shard_in_use(
    sharded_factory: ShardedFactory,
) -> None:
    """A call that times out under a deadline its caller set shorter than the client's
    own may say the caller is in a hurry, not that the shard is down: the client's
    other calls go on using the shard (a second in a row would hold it:
    tests/unit/test_shard_health.py). A timeout under the client's own deadline holds
    it at once."""
    node = sharded_factory()
    key = next(k for k in spread(8) if home(k, 2) == 1)
    stall = "read:delay=0.6:times=1"
    with node.client(ALPHA, retries=0, timeout_s=5.0, faults=stall) as c:
        assert c.put(key, b"v")
        with pytest.raises(TimeoutError_):
            c.get(key, timeout=0.2)
        assert c.get(key) == b"v"
        assert c.counters.get("shard_failures") == 0
    with node.client(ALPHA, retries=0, timeout_s=0.2, faults=stall) as c:
        with pytest.raises(TimeoutError_):
            c.get(key)
        assert c.counters.get("shard_failures") == 1


def test_a_bug_at_one_shards_start_frees_the_others_reservations(
    sharded_factory: ShardedFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layered put whose start on one shard raises something that is not a
    KVStoreError (a bug's) raises it, after aborting the parts that did start: their
    reservations are freed at once, not when their leases run out."""
    node = sharded_factory()
    keys = spread(8)
    on_both(keys)

    def used(shard: int) -> int:
        tiers = node.server(shard).node.stats()["tiers"]
        return sum(int(t["used"]) for t in tiers.values())

    before = used(0)
    real = NodeClient.begin_layers
    bad = node.ports[1][0]

    def begin(c: NodeClient, *args: object, **kw: object) -> object:
        if c.address.endswith(f":{bad}"):
            raise RuntimeError("a bug (injected)")
        return real(c, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeClient, "begin_layers", begin)
    with node.client(ALPHA) as c:
        with pytest.raises(RuntimeError, match="injected"):
            c.begin_layers(keys, shape=SHAPE, dtype=np.float16)
        assert used(0) == before
        monkeypatch.setattr(NodeClient, "begin_layers", real)
        block = np.ones(SHAPE, np.float16)
        with c.begin_layers(keys, shape=SHAPE, dtype=np.float16) as w:
            for layer in range(SHAPE[0]):
                w.write(layer, [block[layer : layer + 1]] * 8)
            assert w.commit() == [True] * 8


@pytest.mark.parametrize("transport", ["shm", "tcp"])  # shm: lost at the commit; tcp: at a layer
def test_a_layered_put_keeps_the_shards_that_live(
    sharded_factory: ShardedFactory, transport: str
) -> None:
    node = sharded_factory()
    keys = spread(8)
    on_both(keys)
    lost = [home(k, 2) == 1 for k in keys]
    block = np.ones(SHAPE, np.float16)
    opts = {"retries": 0, "timeout_s": 2.0, "connect_timeout_s": 2.0, "transport": transport}
    with node.client(ALPHA, **opts) as c:
        w = c.begin_layers(keys, shape=SHAPE, dtype=np.float16)
        w.write(0, [block[:1]] * 8)
        node.stop_shard(1)
        for layer in range(1, SHAPE[0]):
            w.write(layer, [block[layer : layer + 1]] * 8)
        results = w.commit()
        assert [isinstance(r, KVStoreError) for r in results] == lost
        assert [r is True for r in results] == [not x for x in lost]
        kept = [k for k, x in zip(keys, lost, strict=True) if not x]
        assert all(np.array_equal(g, block) for g in c.batch_get(kept))


def test_tenants_never_see_each_other_through_the_node(sharded_node: ShardedNode) -> None:
    keys = spread(16)
    on_both(keys)
    a_vals, b_vals = values(16, 8), [b"bravo's" * 50] * 16
    with sharded_node.client(ALPHA) as a, sharded_node.client(BRAVO) as b:
        assert a.batch_put(keys, a_vals) == [True] * 16
        assert b.exists(keys) == [False] * 16 and b.match_prefix(keys) == 0
        assert b.batch_get(keys) == [None] * 16
        assert b.remove(keys) == 0
        assert b.batch_put(keys, b_vals) == [True] * 16  # its own blocks, same keys
        assert b.batch_get(keys) == b_vals
        got = a.batch_get(keys)
        assert all(np.array_equal(g, v) for g, v in zip(got, a_vals, strict=True))
        assert a.remove(keys) == 16 and b.batch_get(keys) == b_vals  # A's own went


QUOTA_NS = Namespace("quota-model", "float32:L1:H1:D128:B64")
QUOTA_VALUE = np.ones((1, 2, 1, 64, 128), dtype=np.float32)  # 64 KiB, one block


def test_a_tenants_quota_bounds_it_on_the_whole_node(
    sharded_factory: ShardedFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("quota")
    tokens = base_flags(workdir)["tokens_file"]
    tokens.write_text(tokens.read_text() + '\n[quotas.alpha]\ndram = "1MiB"\nssd = "1MiB"\n')
    node = sharded_factory(tokens_file=tokens)
    keys = prefix_keys(list(range(64 * 64)), 64, QUOTA_NS)  # 64 blocks: 4 MiB
    with node.client(ALPHA, namespace=QUOTA_NS) as a:
        for k in keys:
            assert a.put(k, QUOTA_VALUE)  # at its quota it makes room from its own
        held = sum(a.exists(keys))
        server = a.stats()["server"]
        per_shard = [s["server"] for s in a.stats()["shards"]]
    assert 0 < held <= 2 * (1 << 20) // QUOTA_VALUE.nbytes  # DRAM + SSD quotas, node-wide
    for tier in ("dram", "ssd"):
        used = [s.get(f"quota_used_{tier}@alpha", 0) for s in per_shard]
        assert all(0 < u <= (1 << 20) // 2 for u in used)  # each shard: half of it
        assert server[f"quota_used_{tier}@alpha"] == sum(used) <= 1 << 20


def test_a_stale_shard_map_never_reaches_another_node(sharded_factory: ShardedFactory) -> None:
    ours, other = sharded_factory(group="ours"), sharded_factory(group="other")
    with ours.client(ALPHA) as c:
        info = pb.InfoResponse()
        info.CopyFrom(c._info)
        info.shards[1].address = f"127.0.0.1:{other.ports[1][0]}"  # another node's shard 1
        stale = ShardedClient(c, info)
        with pytest.raises(ConflictError, match="shard 1 of 2 of node 'other'"):
            stale.node(1)
        stale.close()


def test_whole_node_false_talks_to_the_dialled_shard_alone(
    sharded_node: ShardedNode, client: StoreClient
) -> None:
    key = next(k for k in iter(lambda: fresh(1)[0], None) if home(k, 2) == 1)
    with sharded_node.client(ALPHA, whole_node=False) as lone:
        assert lone.shards == 1 and lone._sharded is None
        assert lone.put(key, b"on shard 0 alone")
        assert lone.get(key) == b"on shard 0 alone"
    assert client.get(key) is None  # the node looks for it on its shard, 1: a miss


# -- a real ``kvstore serve --shards 2`` ----------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``kvstore serve --shards 2 --json``, stopped by its PID (its shards with it)."""
    workdir = tmp_path_factory.mktemp("serve-shards")
    flags = {**base_flags(workdir), "shards": 2, "max_value_bytes": "4MiB"}
    server = ServerProcess(workdir, flags).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kvstore_serve_shards_is_one_node_to_a_client(
    served: ServerProcess, transport: str
) -> None:
    shards = served.facts["shards"]
    assert [s["index"] for s in shards] == [0, 1]
    keys, vals = spread(32), values(32, 9)
    on_both(keys)
    with served.client(ALPHA, transport=transport) as c:
        assert c.shards == 2
        before = [s["blocks"] for s in c.stats()["shards"]]
        assert c.batch_put(keys, vals) == [True] * 32
        assert c.transport == transport
        outs = [np.zeros_like(v) for v in vals]
        assert c.batch_get_into(keys, outs) == [True] * 32
        assert all(np.array_equal(o, v) for o, v in zip(outs, vals, strict=True))
        assert np.array_equal(c.get(keys[0]), vals[0])
        per_shard = c.stats()["shards"]
    assert [s["node_id"] for s in per_shard] == [s["node_id"] for s in shards]
    for i, s in enumerate(per_shard):
        assert s["blocks"] - before[i] == sum(home(k, 2) == i for k in keys) > 0
