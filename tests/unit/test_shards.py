"""Sharding contracts: which shard holds a key, the supervisor's plan, the shared quota.

``shard_of`` is a wire contract (every client of every version must place a key on the
same shard), so its vectors are pinned here like the key vectors in test_keys.py.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from kvstore.config import NodeConfig, ServerConfig
from kvstore.directory.records import NodeInfo
from kvstore.errors import ConfigError, DirectoryError
from kvstore.server.kv_events import shard_endpoint
from kvstore.server.quotas import Quotas, TenantQuota
from kvstore.server.shards import ShardPlan, shard_count
from kvstore.tier_kinds import TierKind
from kvstore.wire.shards import (
    AUTO_MAX,
    ShardPeer,
    ShardRole,
    auto_shards,
    shard_name,
    shard_of,
)


def _keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]


def test_shard_of_vectors_are_stable() -> None:
    assert [shard_of(k, 4) for k in _keys(8)] == [2, 1, 2, 1, 3, 0, 1, 3]
    assert [shard_of(bytes(16), n) for n in (1, 2, 3, 8)] == [0, 1, 2, 2]
    assert shard_of(b"kvstore-shard-vector", 8) == 3


def test_one_shard_holds_everything() -> None:
    assert {shard_of(k, 1) for k in _keys(100)} == {0}
    assert shard_of(b"x", 0) == 0


def test_keys_spread_evenly() -> None:
    counts = Counter(shard_of(k, 8) for k in _keys(16000))
    assert set(counts) == set(range(8))
    assert all(1600 < c < 2400 for c in counts.values()), counts  # 2000 expected each


def test_growing_the_count_moves_keys_only_to_the_new_shard() -> None:
    keys = _keys(4000)
    for n in (1, 2, 5, 7):
        before = [shard_of(k, n) for k in keys]
        after = [shard_of(k, n + 1) for k in keys]
        moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert all(b == n for _, b in moved)  # jump hash: only into the new shard
        assert len(moved) < 2 * len(keys) / (n + 1)


def test_auto_shards_leaves_half_the_cores_and_needs_dram() -> None:
    gib = 1024**3
    assert auto_shards(64 * gib, cpus=2) == 1
    assert auto_shards(64 * gib, cpus=16) == AUTO_MAX
    assert auto_shards(64 * gib, cpus=6) == 3
    assert auto_shards(3 * gib, cpus=16) == 3  # each shard at least 1 GiB
    assert auto_shards(256 * 1024**2, cpus=64) == 1


def test_role_round_trips_and_refuses_nonsense() -> None:
    peers = (ShardPeer(0, "127.0.0.1:1", "n.s0"), ShardPeer(1, "127.0.0.1:2", "n.s1"))
    role = ShardRole("n", 0, 2, peers)
    assert ShardRole.from_json(role.to_json()) == role
    assert role.node_id == shard_name("n", 0) == "n.s0"
    with pytest.raises(ConfigError, match="no such shard"):
        ShardRole("n", 2, 2)
    with pytest.raises(ConfigError, match="1 to 64"):
        ShardRole("n", 0, 0)
    with pytest.raises(ConfigError, match="in order"):
        ShardRole("n", 0, 2, peers[1:])
    with pytest.raises(ConfigError, match="malformed"):
        ShardRole.from_json('{"group": "n"}')


def _server(**kw: object) -> ServerConfig:
    return ServerConfig(allow_anonymous=True, **kw)  # type: ignore[arg-type]


def test_plan_splits_capacity_and_names_shards(tmp_path: object) -> None:
    node = NodeConfig(
        node_id="box",
        dram_bytes=4 * 1024**3,
        ssd_path="/var/lib/kv",
        ssd_bytes=8 * 1024**3,
        shm_name="seg",
    )
    plan = ShardPlan(node, _server(metrics_port=9400), 4, {"policy": "s3fifo", "port": None})
    peers = tuple(ShardPeer(i, f"h:{i}", shard_name("box", i)) for i in range(4))
    f0 = plan.flags(0, (7400, 7401), peers)
    f3 = plan.flags(3, (0, 0), peers)
    assert f0["dram_bytes"] == f3["dram_bytes"] == 1024**3
    assert f3["ssd_bytes"] == 2 * 1024**3 and f3["ssd_path"] == "/var/lib/kv/shard-3"
    assert (f0["node_id"], f3["node_id"], f3["shm_name"]) == ("box.s0", "box.s3", "seg.s3")
    assert (f0["port"], f0["data_port"], f3["port"]) == (7400, 7401, 0)
    assert f0["metrics_port"] == 0 and f3["policy"] == "s3fifo" and "port" in f3
    assert f0["shards"] == "1"
    assert len(json.loads(f0["shard_role"])["peers"]) == 4
    assert json.loads(f3["shard_role"])["peers"] == []  # only shard 0 hands out the map


def test_plan_refuses_what_shards_cannot_serve() -> None:
    small = NodeConfig(dram_bytes=256 * 1024**2)
    with pytest.raises(ConfigError, match="max_value_bytes"):
        ShardPlan(small, _server(), 8)
    big = NodeConfig(dram_bytes=8 * 1024**3)
    with pytest.raises(ConfigError, match="no port for shard 2"):
        ShardPlan(big, _server(kv_events_endpoint="tcp://127.0.0.1:65534"), 3)
    with pytest.raises(ConfigError, match="too long"):
        ShardPlan(NodeConfig(node_id="n" * 62, dram_bytes=8 * 1024**3), _server(), 12)


def test_shards_setting() -> None:
    assert shard_count(NodeConfig(), _server()) == 1  # auto: 256 MiB is one shard
    assert shard_count(NodeConfig(), _server(shards="3")) == 3
    for bad in ("0", "65", "many", "-1"):
        with pytest.raises(ConfigError, match="shards"):
            _server(shards=bad)


def test_quota_is_shared_among_shards() -> None:
    q = TenantQuota("alpha", {TierKind.DRAM: 10 * 1024**2}, reservations=5, reserved_bytes=0)
    shares = Quotas([q]).share(4)
    part = shares.get("alpha")
    assert part is not None
    assert part.tier_bytes[TierKind.DRAM] == -(-10 * 1024**2 // 4)
    assert part.reservations == 2  # rounded up: a tenant may always reserve one
    assert part.reserved_bytes == 0  # unlimited stays unlimited
    assert Quotas([q]).share(1).get("alpha") is q


def test_node_record_carries_its_shard() -> None:
    info = NodeInfo("box.s1", "h", "h:1", group="box", shard=1, shards=2)
    back = NodeInfo.from_json(info.to_json())
    assert (back.group, back.shard, back.shards) == ("box", 1, 2)
    whole = NodeInfo.from_json(NodeInfo("box", "h", "h:1").to_json())
    assert (whole.group, whole.shard, whole.shards) == ("", 0, 1)
    bad = info.to_json().replace(b'"shard":1', b'"shard":2')
    with pytest.raises(DirectoryError):
        NodeInfo.from_json(bad)


def test_each_shard_publishes_kv_events_where_vllm_puts_a_dp_rank() -> None:
    big = NodeConfig(dram_bytes=8 * 1024**3)
    server = _server(
        kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint="ipc:///tmp/r"
    )
    plan = ShardPlan(big, server, 3)
    flags = [plan.flags(i, (0, 0), ()) for i in range(3)]
    assert [f["kv_events_endpoint"] for f in flags] == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "tcp://127.0.0.1:5559",
    ]
    assert [f["kv_events_replay_endpoint"] for f in flags] == [
        "ipc:///tmp/r",
        "ipc:///tmp/r_dp1",
        "ipc:///tmp/r_dp2",
    ]
    assert shard_endpoint("tcp://127.0.0.1:*", 5) == "tcp://127.0.0.1:*"  # the system picks
    assert shard_endpoint("tcp://[::1]:0", 1) == "tcp://[::1]:0"
    assert shard_endpoint("inproc://events", 2) == "inproc://events_dp2"
