"""A real cluster: etcd plus ``kvstore serve --etcd`` processes, used through
``StoreClient.from_etcd``. Covers registration (seen by ``kvstore nodes`` / ``ls``),
puts and gets across nodes, nearest-replica choice, fallback on a miss and on a dead
node, a node SIGKILLed under readers, a duplicate node id, and a restarted node
waiting out its old lease. Node lease TTLs are 2 s (etcd's minimum).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import AsyncStoreClient, StoreClient
from kvstore.cli import main
from kvstore.client.admin import AdminClient
from kvstore.client.cluster import ClusterClient
from kvstore.directory import NodeInfo
from kvstore.directory.background import BackgroundDirectory
from kvstore.directory.etcd_process import EtcdProcess, free_port
from kvstore.events import BlockStored
from kvstore.tier_kinds import TierKind
from tests.support.server_process import ADMIN, ALPHA, ServerProcess, base_flags, principal_of
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

from kvstore.directory.etcd import EtcdDirectory

TTL = 2
ROOT = Path(__file__).resolve().parents[2]
SCOPE = principal_of(ALPHA)


def value_for(key: bytes) -> np.ndarray:
    """Bytes derived from the key, so a wrong block can never look right."""
    return np.frombuffer(hashlib.sha512(key).digest() * 32, dtype=np.uint8).copy()


def start_node(workdir: Path, node_id: str, etcd: str, cluster: str, **flags: Any) -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    merged = {
        **base_flags(workdir),
        "node_id": node_id,
        "dram_bytes": "32MiB",
        "ssd_bytes": "64MiB",
        "etcd": etcd,
        "cluster": cluster,
        "node_lease_ttl_s": TTL,
        **flags,
    }
    return ServerProcess(workdir, merged).start()


def start_nodes(root: Path, ids: list[str], etcd: str, cluster: str) -> list[ServerProcess]:
    with ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(lambda n: start_node(root / n, n, etcd, cluster), ids))


@dataclass
class Cluster:
    etcd: str
    name: str
    servers: dict[str, ServerProcess]

    def client(self, **kw: Any) -> ClusterClient:
        kw.setdefault("timeout_s", 5.0)
        return StoreClient.from_etcd(self.etcd, cluster=self.name, token=ALPHA.token, **kw)


@pytest.fixture(scope="module")
def pair(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Nodes ``a`` and ``b`` registered in one cluster, for the whole module."""
    name = f"pair-{os.getpid()}"
    servers = start_nodes(tmp_path_factory.mktemp("pair"), ["a", "b"], etcd_server.endpoint, name)
    try:
        yield Cluster(etcd_server.endpoint, name, {s.facts["node_id"]: s for s in servers})
    finally:
        for s in servers:
            s.stop()


def replicas(c: ClusterClient, key: bytes) -> dict[str, TierKind]:
    return {r.node_id: r.tier for r in c.mirror.replicas(SCOPE.scope(key))}


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- registration and the CLI readers ------------------------------------------------------


def test_registration_is_visible_to_nodes_and_ls(
    pair: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ("--etcd", pair.etcd, "--cluster", pair.name)
    doc = cli_json(capsys, "nodes", *where)
    nodes = {n["node_id"]: n for n in doc["nodes"]}
    assert set(nodes) == {"a", "b"}
    for node_id, s in pair.servers.items():
        n = nodes[node_id]
        assert n["address"] == s.address
        assert n["data_address"] == f"127.0.0.1:{s.data_port}"
        assert n["shm_name"] == s.facts["shm_name"]
        assert n["tiers"] == {"dram": 32 << 20, "ssd": 64 << 20}
        assert n["host_id"] and n["boot_id"]

    key = os.urandom(16)
    with pair.client(node_id="b") as c:
        assert c.put(key, value_for(key)) is True
        wait_until(lambda: replicas(c, key) == {"b": TierKind.DRAM}, "put reaches mirror", within=5)
    entries = cli_json(capsys, "ls", *where, "--node", "b", "--prefix", SCOPE.scope(key).hex()[:8])
    assert [(e["node"], e["tier"]) for e in entries["entries"]] == [("b", "dram")]

    capsys.readouterr()
    assert main(["nodes", *where]) == 0
    assert main(["ls", *where, "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "127.0.0.1:" in out and max(len(line) for line in out.splitlines()) <= 80


# -- from_etcd: puts, gets, choice of replica, fallback -----------------------------------


def test_from_etcd_puts_to_chosen_node_and_gets_across_nodes(pair: Cluster) -> None:
    ka, kb = [os.urandom(16) for _ in range(8)], [os.urandom(16) for _ in range(8)]
    with pair.client(node_id="a") as ca, pair.client(node_id="b") as cb:
        assert ca.batch_put(ka, [value_for(k) for k in ka]) == [True] * 8
        assert cb.batch_put(kb, [value_for(k) for k in kb]) == [True] * 8
        assert ca.match_prefix(ka) == 8  # own puts count before the directory shows them
    with pair.client() as c:
        wait_until(lambda: c.match_prefix(ka + kb) == 16, "mirror shows both nodes' puts", within=5)
        assert c.exists([ka[0], os.urandom(16), kb[-1]]) == [True, False, True]
        assert c.longest_prefix(ka) == {"a": 8} and c.longest_prefix(kb) == {"b": 8}
        for k, got in zip(ka + kb, c.batch_get(ka + kb), strict=True):
            assert np.array_equal(got, value_for(k))
        out = np.empty_like(value_for(ka[0]))
        assert c.get_into(ka[0], out) and np.array_equal(out, value_for(ka[0]))
        assert c.get(os.urandom(16)) is None  # a miss everywhere, with no round trip
        served = c.stats()["client"]
        assert served["served.a"] == 9 and served["served.b"] == 8
        assert c.remove(ka[:2]) == 2
        assert c.get(ka[0]) is None  # even while the mirror still lists it: a miss on a
        wait_until(lambda: c.exists(ka[:3]) == [False, False, True], "removal in mirror", within=5)


def test_layer_by_layer_writes_through_a_cluster_client(pair: Cluster) -> None:
    """begin_layers on the cluster client writes on the chosen node, its keys count as
    present for this client at once, and other clients read them across nodes."""
    keys = [os.urandom(16) for _ in range(3)]
    values = [value_for(k).reshape(4, -1) for k in keys]  # 4 layers of 4 KiB
    with pair.client(node_id="b") as cb:
        with cb.begin_layers(keys, shape=values[0].shape, dtype=np.uint8) as w:
            for layer in range(4):
                w.write(layer, [v[layer : layer + 1] for v in values])
            assert w.commit() == [True] * 3
        assert cb.match_prefix(keys) == 3  # before the directory shows them
    with pair.client() as c:
        wait_until(lambda: c.match_prefix(keys) == 3, "mirror shows the layered write", within=5)
        assert all(replicas(c, k) == {"b": TierKind.DRAM} for k in keys)
        for k, v in zip(keys, c.batch_get(keys), strict=True):
            assert np.array_equal(v, value_for(k).reshape(4, -1))


def test_async_client_of_a_cluster(pair: Cluster) -> None:
    keys = [os.urandom(16) for _ in range(4)]

    async def go() -> None:
        c = await AsyncStoreClient.from_etcd(
            pair.etcd, cluster=pair.name, token=ALPHA.token, node_id="b", timeout_s=5.0
        )
        try:
            assert await c.batch_put(keys, [value_for(k) for k in keys]) == [True] * 4
            assert await c.match_prefix(keys) == 4
            got = await asyncio.gather(*(c.get(k) for k in keys))
            assert all(np.array_equal(g, value_for(k)) for g, k in zip(got, keys, strict=True))
            out = np.empty_like(value_for(keys[0]))
            assert await c.get_into(keys[0], out) and np.array_equal(out, value_for(keys[0]))
            assert (await c.stats())["client"]["served.b"] >= 5
            assert await c.remove(keys) == 4
        finally:
            await c.close()
        assert c.state == "closed"

    asyncio.run(go())


def test_gets_prefer_the_faster_tier(pair: Cluster) -> None:
    key = os.urandom(16)
    with pair.client(node_id="a") as ca, pair.client(node_id="b") as cb:
        ca.put(key, value_for(key))
        cb.put(key, value_for(key))
        wait_until(lambda: len(replicas(ca, key)) == 2, "both replicas in the mirror", within=5)
    with pair.servers["a"].client(ADMIN) as admin:
        AdminClient(admin).evict("dram", 0)  # a's copy goes to SSD; b's stays in DRAM
    with pair.client() as c:
        want = {"a": TierKind.SSD, "b": TierKind.DRAM}
        wait_until(lambda: replicas(c, key) == want, "demotion reaches the mirror", within=5)
        before = c.stats()["nodes"]["a"]["counters"].get("hits_ssd", 0)
        assert np.array_equal(c.get(key), value_for(key))
        assert c.counters.get("served.b") == 1 and not c.counters.get("served.a")
        assert c.stats()["nodes"]["a"]["counters"].get("hits_ssd", 0) == before


def test_fallback_past_a_stale_entry_and_a_dead_node(pair: Cluster) -> None:
    """Entries that rank first (HBM) but lie: one on a live node that lacks the block,
    one on a node nobody listens for. Reads still return the right bytes."""
    k_stale, k_dead = os.urandom(16), os.urandom(16)
    here, hbm = socket.gethostname(), {TierKind.HBM: 1}
    liar = NodeInfo("liar", here, pair.servers["a"].address, tiers=hbm)  # a lacks k_stale
    ghost = NodeInfo("ghost", here, f"127.0.0.1:{free_port()}", tiers=hbm)

    async def register() -> None:
        assert bg.directory is not None
        for info, key in ((liar, k_stale), (ghost, k_dead)):
            await bg.directory.register_node(info, ttl=TTL)
            await bg.directory.publish(
                info.node_id, [BlockStored(SCOPE.scope(key), TierKind.HBM, 9, b"")]
            )

    with (
        BackgroundDirectory(lambda: EtcdDirectory(pair.etcd, pair.name)) as bg,
        pair.client(node_id="b") as c,
    ):
        bg.call(register)
        assert c.batch_put([k_stale, k_dead], [value_for(k_stale), value_for(k_dead)])
        wait_until(
            lambda: len(replicas(c, k_dead)) == len(replicas(c, k_stale)) == 2,
            "both keys' replicas in the mirror",
            within=5,
        )
        assert [r.node_id for r in c.mirror.ranked(SCOPE.scope(k_dead))] == ["ghost", "b"]
        for key in (k_stale, k_dead):
            assert np.array_equal(c.get(key), value_for(key))
        assert c.counters.get("fallbacks") == 2 and c.counters.get("node_failures") == 1
        assert c.counters.get("served.b") == 2


# -- faults --------------------------------------------------------------------------------


def test_sigkilled_node_under_readers(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    """Readers see the other replica (or a miss), never wrong bytes; the dead node's
    entries leave the directory within the lease TTL plus a second."""
    c_srv, d_srv = start_nodes(tmp_path, ["c", "d"], etcd_server.endpoint, cluster_name)
    cl = Cluster(etcd_server.endpoint, cluster_name, {"c": c_srv, "d": d_srv})
    ks = [os.urandom(16) for _ in range(32)]
    try:
        for node in ("c", "d"):
            with cl.client(node_id=node) as w:
                assert w.batch_put(ks, [value_for(k) for k in ks]) == [True] * len(ks)
        with cl.client(timeout_s=3.0) as reader:
            wait_until(lambda: all(len(replicas(reader, k)) == 2 for k in ks), "replicas", within=5)
            stats = _read_while_killing(reader, ks, c_srv)
            assert stats["wrong"] == 0 and stats["errors"] == [], stats
            assert stats["after_kill"] > 0 and stats["hits"] > 0
            wait_until(
                lambda: reader.mirror.node("c") is None and not reader.mirror.entries("c"),
                "the dead node's entries vanish",
                within=TTL + 3,
            )
            gone_after = time.monotonic() - stats["killed_at"]
            assert gone_after <= TTL + 1.0, f"entries outlived the kill by {gone_after:.2f} s"
            got = reader.batch_get(ks)
            assert all(np.array_equal(v, value_for(k)) for k, v in zip(ks, got, strict=True))
    finally:
        c_srv.stop()
        d_srv.stop()


def _read_while_killing(reader: ClusterClient, ks: list[bytes], victim: ServerProcess) -> dict:
    """Two threads read ``ks`` in a loop; ``victim`` is SIGKILLed once both have read a
    few rounds; they stop after a few more rounds each (all bounded)."""
    stats: dict[str, Any] = {"wrong": 0, "hits": 0, "misses": 0, "errors": [], "after_kill": 0}
    started = threading.Barrier(3, timeout=10)
    killed = threading.Event()
    lock = threading.Lock()

    def loop() -> None:
        rounds_after = 0
        started.wait()
        deadline = time.monotonic() + 15
        while rounds_after < 5 and time.monotonic() < deadline:
            after = killed.is_set()
            try:
                got = reader.batch_get(ks)
            except Exception as exc:
                with lock:
                    stats["errors"].append(repr(exc))
                continue
            with lock:
                for k, v in zip(ks, got, strict=True):
                    if v is None:
                        stats["misses"] += 1
                    elif np.array_equal(v, value_for(k)):
                        stats["hits"] += 1
                    else:
                        stats["wrong"] += 1
                stats["after_kill"] += after
            rounds_after += after

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    wait_until(lambda: reader.counters.get("served.c") >= 64, "readers warmed up on c", within=10)
    os.kill(victim.pid, signal.SIGKILL)
    stats["killed_at"] = time.monotonic()
    killed.set()
    for t in threads:
        t.join(20)
    return stats


def test_duplicate_node_id_is_refused(pair: Cluster, tmp_path: Path) -> None:
    flags = {**base_flags(tmp_path), "node_id": "a", "etcd": pair.etcd, "cluster": pair.name}
    with pair.client() as c:
        before = c.nodes()["a"]
    argv = ServerProcess(tmp_path, flags).argv()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    assert done.returncode != 0 and time.monotonic() - t0 < 15
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("kvstore serve: error:")]
    assert len(errors) == 1, done.stderr
    assert "already served by a live node at " + pair.servers["a"].address in errors[0]
    assert "error code: conflict" in done.stderr
    with pair.client() as c:
        assert c.nodes()["a"] == before  # the live holder is untouched


def test_restarted_node_waits_out_its_old_lease(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    s = start_node(tmp_path / "e", "e", etcd_server.endpoint, cluster_name)
    try:
        with BackgroundDirectory(lambda: EtcdDirectory(etcd_server.endpoint, cluster_name)) as bg:
            assert bg.mirror is not None
            old = bg.mirror.node("e")
            assert old is not None
            t0 = time.monotonic()
            s.restart(signal.SIGKILL)  # same ports: the old record names our address
            took = time.monotonic() - t0
            m = bg.mirror
            wait_until(
                lambda: (m.node("e") or old).epoch != old.epoch, "new epoch in mirror", within=5
            )
            assert m.node("e").boot_id != old.boot_id  # type: ignore[union-attr]
            assert took <= TTL + 5
    finally:
        s.stop()


@pytest.mark.process
def test_up_two_nodes_then_sigterm_stops_everything(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    from tests.support.etcd_fixtures import require_etcd

    require_etcd()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-m", "kvstore.cli", "up", "--nodes", "2", "--dram", "32MiB", "--json"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    pids: list[int] = []
    try:
        doc = _ready(up)
        pids = [n["pid"] for n in doc["nodes"]] + [doc["etcd_pid"]]
        assert len(doc["nodes"]) == 2 and all(_alive(p) for p in pids)
        key = os.urandom(16)
        with StoreClient.from_etcd(doc["etcd"], cluster=doc["cluster"], token=doc["token"]) as c:
            assert set(c.nodes()) == {"n0", "n1"}
            assert c.put(key, value_for(key)) is True
            assert np.array_equal(c.get(key), value_for(key))
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        wait_until(lambda: not any(_alive(p) for p in pids), "every child gone", within=10)
        assert not Path(doc["root"]).exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        for p in pids:  # only if the test failed: never leave them behind
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    import select

    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return dict(json.loads(line))
        if proc.poll() is not None:
            break
    raise AssertionError("kvstore up did not print its ready document")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is gone but unreaped
    except (FileNotFoundError, IndexError):
        return False
