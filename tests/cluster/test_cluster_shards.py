"""A sharded node in a real cluster: etcd, ``kvstore serve --shards 2 --etcd ...`` (node
``g``, served by shards ``g.s0`` and ``g.s1``) and an ordinary ``kvstore serve`` (``a``),
used through ``StoreClient.from_etcd`` and the operator's commands.

A cluster client writing to ``g`` puts each key on shard ``shard_of(stored key, 2)`` (the
directory lists it there, the shard's own stats count it); other clients, in this
process and in another, read every block back; ``kvstore nodes`` and ``kvstore stats``
show ``g`` as one node with its shards; ``kvstore drain g`` marks every shard draining
and new writes go to ``a``, while ``kvstore drain g.s1`` drains that shard alone (and
with it the group, for writers). The routing logic alone, hermetic:
tests/cluster/test_shard_routing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.client.cluster import ClusterClient
from kvstore.client.store import NodeClient
from kvstore.directory.etcd_process import EtcdProcess
from kvstore.errors import ConfigError
from kvstore.tier_kinds import TierKind
from kvstore.wire.shards import shard_of
from tests.cluster.test_cluster import ROOT, TTL, Cluster, cli_json, replicas, start_node, value_for
from tests.support.server_process import ADMIN, ALPHA, ServerProcess, base_flags, principal_of
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

SHARDS = ("g.s0", "g.s1")


def start_sharded(workdir: Path, etcd: str, cluster: str) -> ServerProcess:
    """``kvstore serve --shards 2`` as node ``g``: each shard 16 MiB of DRAM and SSD."""
    workdir.mkdir(parents=True, exist_ok=True)
    flags = {
        **base_flags(workdir),
        "node_id": "g",
        "shards": 2,
        "dram_bytes": "32MiB",
        "ssd_bytes": "32MiB",
        "max_value_bytes": "1MiB",
        "etcd": etcd,
        "cluster": cluster,
        "node_lease_ttl_s": TTL,
    }
    return ServerProcess(workdir, flags).start()


@pytest.fixture(scope="module")
def sharded(
    etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Node ``g`` in two shards and node ``a``, in one cluster, for the module."""
    name = f"shards-{os.getpid()}"
    root = tmp_path_factory.mktemp("shards")
    g = start_sharded(root / "g", etcd_server.endpoint, name)
    try:
        a = start_node(root / "a", "a", etcd_server.endpoint, name)
    except BaseException:
        g.stop()
        raise
    try:
        assert [s["node_id"] for s in g.facts["shards"]] == list(SHARDS)
        yield Cluster(etcd_server.endpoint, name, {"g": g, "a": a})
    finally:
        g.stop()
        a.stop()


def shard_address(cl: Cluster, i: int) -> str:
    return f"127.0.0.1:{cl.servers['g'].facts['shards'][i]['port']}"


def wait_for_nodes(c: ClusterClient) -> None:
    wait_until(lambda: set(c.nodes()) >= {*SHARDS, "a"}, "every shard and a listed", within=10)


def where(cl: Cluster) -> tuple[str, ...]:
    return ("--etcd", cl.etcd, "--cluster", cl.name)


def read_in_another_process(cl: Cluster, keys: list[bytes]) -> list[str]:
    """The keys read by a fresh cluster client in a child process: each block's sha256,
    or "miss"."""
    script = (
        "import hashlib, json, sys\n"
        "from kvstore import StoreClient\n"
        "etcd, cluster, token, keys = sys.argv[1:4] + [sys.argv[4].split(',')]\n"
        "with StoreClient.from_etcd(etcd, cluster=cluster, token=token) as c:\n"
        "    got = c.batch_get([bytes.fromhex(k) for k in keys])\n"
        "print(json.dumps([hashlib.sha256(v.tobytes()).hexdigest() if v is not None\n"
        "                  else 'miss' for v in got]))\n"
    )
    argv = [sys.executable, "-c", script, cl.etcd, cl.name, ALPHA.token]
    argv.append(",".join(k.hex() for k in keys))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def shard_blocks(cl: Cluster) -> dict[str, int]:
    """Each shard's block count, from its own stats."""
    out = {}
    for i, node_id in enumerate(SHARDS):
        with NodeClient.connect(shard_address(cl, i), token=ADMIN.token) as c:  # that shard
            st = c.stats()
            assert st["node_id"] == node_id
            out[node_id] = int(st["blocks"])
    return out


def test_puts_land_on_their_shard_and_every_client_reads_them(sharded: Cluster) -> None:
    cl = sharded
    keys = [os.urandom(16) for _ in range(40)]
    before = shard_blocks(cl)
    with cl.client(node_id="g") as w:
        wait_for_nodes(w)
        assert w.members.write_order()[0] == "g"
        assert w.batch_put(keys, [value_for(k) for k in keys]) == [True] * 40
        assert w.members.writer == "g"
        scope = principal_of(ALPHA).scope  # placement is by the stored (scoped) key
        want = {k: f"g.s{shard_of(scope(k), 2)}" for k in keys}
        assert set(want.values()) == set(SHARDS)  # 40 keys: both shards take some
        wait_until(
            lambda: all(replicas(w, k) == {want[k]: TierKind.DRAM} for k in keys),
            "each block listed on its shard",
            within=10,
        )
    after = shard_blocks(cl)
    for node_id in SHARDS:
        assert after[node_id] - before[node_id] == sum(1 for n in want.values() if n == node_id)
    with cl.client(node_id="a") as r:  # another client instance, writing elsewhere
        wait_for_nodes(r)
        got = r.batch_get(keys)
        assert all(np.array_equal(v, value_for(k)) for k, v in zip(keys, got, strict=True))
        served = r.counters.snapshot()
        assert served.get("served.g.s0", 0) + served.get("served.g.s1", 0) == 40
        assert r.longest_prefix(keys) == {"g": 40}
    digests = [hashlib.sha256(value_for(k).tobytes()).hexdigest() for k in keys]
    assert read_in_another_process(cl, keys) == digests


def test_nodes_and_stats_show_the_node_and_its_shards(
    sharded: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cl = sharded
    nodes = {n["node_id"]: n for n in cli_json(capsys, "nodes", *where(cl))["nodes"]}
    assert set(nodes) == {*SHARDS, "a"}
    for i, node_id in enumerate(SHARDS):
        n = nodes[node_id]
        assert (n["group"], n["shard"], n["shards"]) == ("g", i, 2)
        assert n["address"] == shard_address(cl, i)
        assert n["tiers"] == {"dram": 16 << 20, "ssd": 16 << 20}
    assert (nodes["a"]["group"], nodes["a"]["shard"], nodes["a"]["shards"]) == ("", 0, 1)

    capsys.readouterr()
    assert main(["nodes", *where(cl)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "2 nodes (3 with each shard)" in out, out
    assert out.index("g (2 shards)") < out.index("  g.s0") < out.index("  g.s1")  # beneath
    assert max(len(line) for line in lines) <= 80

    doc = cli_json(capsys, "stats", *where(cl), "--token", ADMIN.token)
    assert doc["errors"] == []
    per_node = {d["node_id"]: d for d in doc["nodes"]}
    assert set(per_node) == {*SHARDS, "a"}
    [group] = doc["groups"]
    assert group["node_id"] == "g" and group["shard_nodes"] == list(SHARDS)
    assert group["blocks"] == per_node["g.s0"]["blocks"] + per_node["g.s1"]["blocks"]
    dram = group["tiers"]["dram"]
    assert dram["capacity"] == 32 << 20
    assert dram["used"] == sum(per_node[n]["tiers"]["dram"]["used"] for n in SHARDS)
    by_address = cli_json(
        capsys, "stats", "--node", cl.servers["g"].address, "--token", ALPHA.token
    )
    assert [d["node_id"] for d in by_address["nodes"]] == list(SHARDS)  # shard 0 names them
    assert [g["node_id"] for g in by_address["groups"]] == ["g"]

    capsys.readouterr()
    assert main(["stats", "--node", "g", *where(cl), "--token", ALPHA.token]) == 0
    out = capsys.readouterr().out
    assert "g.s0" in out and "g.s1" in out and max(len(x) for x in out.splitlines()) <= 80


def drained(cl: Cluster, capsys: pytest.CaptureFixture[str]) -> dict[str, bool]:
    nodes = cli_json(capsys, "nodes", *where(cl))["nodes"]
    return {n["node_id"]: n["draining"] for n in nodes}


def test_draining_the_group_drains_every_shard_and_writes_go_elsewhere(
    sharded: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cl = sharded
    admin = ("--token", ADMIN.token, *where(cl))
    old = [os.urandom(16) for _ in range(12)]
    with cl.client(node_id="g") as w:
        wait_for_nodes(w)
        assert w.batch_put(old, [value_for(k) for k in old]) == [True] * 12
        doc = cli_json(capsys, "drain", "g", "--to", "a", *admin)
        assert doc["group"] == "g" and [s["node_id"] for s in doc["shards"]] == list(SHARDS)
        assert doc["remaining"] == 0 and doc["missing"] == []
        assert drained(cl, capsys) == {"g.s0": True, "g.s1": True, "a": False}
        wait_until(lambda: w.members.write_order() == ["a"], "the writer sees the drain", 10)
        new = [os.urandom(16) for _ in range(8)]
        assert w.batch_put(new, [value_for(k) for k in new]) == [True] * 8
        assert w.members.writer == "a"
        wait_until(
            lambda: all(replicas(w, k) == {"a": TierKind.DRAM} for k in old + new),
            "moved and new blocks listed on a",
            within=10,
        )
        got = w.batch_get(old + new)
        assert all(np.array_equal(v, value_for(k)) for k, v in zip(old + new, got, strict=True))

        assert main(["drain", "g", "--undo", *admin]) == 0
        assert drained(cl, capsys) == {"g.s0": False, "g.s1": False, "a": False}
        wait_until(lambda: w.members.write_order()[0] == "g", "the writer back on g", 10)

        assert main(["drain", "g.s1", "--drop", *admin]) == 0  # one shard alone
        assert drained(cl, capsys) == {"g.s0": False, "g.s1": True, "a": False}
        wait_until(lambda: w.members.write_order() == ["a"], "a shard drains its group", 10)
        assert main(["drain", shard_address(cl, 1), "--undo", "--token", ADMIN.token]) == 0
        assert drained(cl, capsys) == {"g.s0": False, "g.s1": False, "a": False}


def test_drain_by_address_of_shard_0_drains_the_node(
    sharded: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cl = sharded
    address = cl.servers["g"].address
    rc = main(["drain", address, "--drop", "--token", ADMIN.token, "--json"])
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["group"] == "g" and doc["remaining"] == 0
    assert drained(cl, capsys) == {"g.s0": True, "g.s1": True, "a": False}
    assert main(["drain", address, "--undo", "--token", ADMIN.token]) == 0
    assert drained(cl, capsys) == {"g.s0": False, "g.s1": False, "a": False}
    capsys.readouterr()
    assert main(["drain", "nope", "--drop", "--token", ADMIN.token, *where(cl)]) == 1
    assert "no node named 'nope'" in capsys.readouterr().err


@pytest.mark.process
def test_up_starts_each_node_as_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.procs.local_cluster import LocalCluster
    from tests.support.etcd_fixtures import require_etcd

    require_etcd()
    with pytest.raises(ConfigError):
        LocalCluster(1, shards="0", root=tmp_path)  # refused before anything starts
    with LocalCluster(1, dram="128MiB", shards="2", allow_anonymous=True, root=tmp_path) as up:
        doc = up.describe()
        assert doc["nodes"][0]["node_id"] == "n0"
        assert doc["nodes"][0]["shards"] == ["n0.s0", "n0.s1"]
        listed = cli_json(capsys, "nodes", "--etcd", doc["etcd"], "--cluster", doc["cluster"])
        assert {(n["node_id"], n["group"], n["shards"]) for n in listed["nodes"]} == {
            ("n0.s0", "n0", 2),
            ("n0.s1", "n0", 2),
        }
