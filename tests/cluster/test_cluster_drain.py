"""Operator commands on a real cluster (etcd + two ``kvstore serve --etcd`` processes):
a drain moves clients' writes off a node through its directory record while its
blocks stay readable, and ``kvstore ls --tenant/--namespace`` asks every node for
exactly the blocks of one namespace, blocks a drain moved (and a restart reloaded)
included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.cli import main
from kvstore.client.admin import AdminClient
from kvstore.client.cluster import ClusterClient
from kvstore.directory.etcd_process import EtcdProcess
from kvstore.tier_kinds import TierKind
from tests.cluster.test_cluster import (
    Cluster,
    cli_json,
    replicas,
    start_nodes,
    value_for,
)
from tests.support.background import Background
from tests.support.server_process import ADMIN, ALPHA, BRAVO, ServerProcess, principal_of
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

LAYOUT = "uint8:L1:H1:D1"
SHAPE = (1, 2, 1, 256, 1)  # 512 bytes of uint8 in LAYOUT


def two_nodes(etcd: EtcdProcess, name: str, root: Path) -> Cluster:
    a, b = start_nodes(root, ["a", "b"], etcd.endpoint, name)
    return Cluster(etcd.endpoint, name, {"a": a, "b": b})


def stop(cl: Cluster) -> None:
    for s in cl.servers.values():
        s.stop()


def nodes_doc(capsys: pytest.CaptureFixture[str], cl: Cluster) -> dict[str, Any]:
    doc = cli_json(capsys, "nodes", "--etcd", cl.etcd, "--cluster", cl.name)
    return {n["node_id"]: n for n in doc["nodes"]}


class _Load(Background):
    """A writer putting fresh keys and a reader getting ``old`` keys, both through
    ClusterClients, until stopped; every exception and wrong byte is kept."""

    def __init__(self, writer: ClusterClient, reader: ClusterClient, old: list[bytes]) -> None:
        self.writer, self.reader, self.old = writer, reader, old
        self.errors: list[str] = []
        self.written: list[bytes] = []
        self.rounds = self.misses = self.wrong = 0
        super().__init__(self._write, self._read)

    def progress(self, n: int) -> None:
        """Wait until both loops did ``n`` more rounds (bounded)."""
        r, w = self.rounds + n, len(self.written) + n
        wait_until(lambda: self.rounds >= r and len(self.written) >= w, "load progress", within=10)

    def _write(self) -> None:
        while not self.stop.is_set():
            k = os.urandom(16)
            try:
                if self.writer.put(k, value_for(k)) is not True:
                    self.errors.append(f"put {k.hex()}: not stored")
            except Exception as exc:
                self.errors.append(f"put: {exc!r}")
                continue
            self.written.append(k)

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                got = self.reader.batch_get(self.old)
            except Exception as exc:
                self.errors.append(f"get: {exc!r}")
                continue
            for k, v in zip(self.old, got, strict=True):
                if v is None:
                    self.misses += 1
                elif not np.array_equal(v, value_for(k)):
                    self.wrong += 1
            self.rounds += 1


def test_drain_moves_writes_off_the_node_and_no_request_fails(
    etcd_server: EtcdProcess,
    cluster_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cl = two_nodes(etcd_server, cluster_name, tmp_path)
    a, b = cl.servers["a"], cl.servers["b"]
    old = [os.urandom(16) for _ in range(40)]
    try:
        with cl.client(node_id="a") as writer, cl.client() as reader:
            assert writer.batch_put(old, [value_for(k) for k in old]) == [True] * 40
            wait_until(
                lambda: all(replicas(reader, k) == {"a": TierKind.DRAM} for k in old),
                "the old blocks listed on a",
                within=5,
            )
            with _Load(writer, reader, old) as load:
                load.progress(3)
                assert writer.members.writer == "a"
                with a.client(ADMIN) as admin:
                    assert admin.set_draining(True) is True
                # Written before the call returned: a fresh listing shows it at once.
                nodes = nodes_doc(capsys, cl)
                assert nodes["a"]["draining"] and not nodes["b"]["draining"]
                wait_until(
                    lambda: writer.mirror.node("a").draining,  # type: ignore[union-attr]
                    "mirror sees the drain",
                    within=5,
                )
                since = len(load.written) + 1  # one put may have been in flight
                load.progress(5)
                assert writer.members.writer == "b"
                moved_on = load.written[since:]
                wait_until(
                    lambda: all(replicas(reader, k) == {"b": TierKind.DRAM} for k in moved_on),
                    "puts after the drain are on b",
                    within=5,
                )
                assert load.misses == load.wrong == 0 and load.errors == []  # a still serves

                rc = main(["drain", a.address, "--to", b.address, "--token", ADMIN.token, "--json"])
                assert rc == 0
                load.progress(3)
            assert load.errors == [] and load.wrong == 0, load.errors[:5]
            wait_until(
                lambda: all(replicas(reader, k) == {"b": TierKind.DRAM} for k in old),
                "moved blocks are listed on b only",
                within=5,
            )
            got = reader.batch_get(old)
            assert all(np.array_equal(v, value_for(k)) for k, v in zip(old, got, strict=True))

            capsys.readouterr()
            assert main(["nodes", "--etcd", cl.etcd, "--cluster", cl.name]) == 0
            row = next(line for line in capsys.readouterr().out.splitlines() if " a " in line)
            assert "draining" in row

            assert main(["drain", a.address, "--undo", "--token", ADMIN.token]) == 0
            assert not nodes_doc(capsys, cl)["a"]["draining"]
            wait_until(
                lambda: not writer.mirror.node("a").draining,  # type: ignore[union-attr]
                "undo reaches mirror",
                within=5,
            )
            assert writer.members.write_order()[0] == "a"  # the node asked for, again
    finally:
        stop(cl)


def test_a_draining_node_that_loses_its_lease_re_registers_draining(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    """The drain is part of the node's registration, not of one lease."""
    from kvstore.directory.background import BackgroundDirectory
    from kvstore.directory.etcd import EtcdDirectory

    cl = two_nodes(etcd_server, cluster_name, tmp_path)
    try:
        with cl.servers["a"].client(ADMIN) as admin:
            admin.set_draining(True)
        with BackgroundDirectory(lambda: EtcdDirectory(cl.etcd, cl.name)) as bg:
            m = bg.start()
            before = m.node("a")
            assert before is not None and before.draining

            async def revoke() -> None:
                assert bg.directory is not None
                await bg.directory._revoke(before.epoch)  # type: ignore[attr-defined]

            bg.call(revoke)

            def again() -> bool:
                n = m.node("a")
                return n is not None and n.epoch != before.epoch

            wait_until(again, "a re-registers under a new lease", within=10)
            assert m.node("a").draining  # type: ignore[union-attr]
    finally:
        stop(cl)


def _value(i: int) -> np.ndarray:
    return np.full(SHAPE, i % 251, dtype=np.uint8)


def test_ls_by_namespace_asks_each_node_and_is_exact(
    etcd_server: EtcdProcess,
    cluster_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cl = two_nodes(etcd_server, cluster_name, tmp_path)
    where = ("--etcd", cl.etcd, "--cluster", cl.name)
    want: dict[tuple[str, str], set[tuple[str, str]]] = {}
    plan: list[tuple[str, Any, str, int]] = [
        ("a", ALPHA, "m1", 5),
        ("a", ALPHA, "m2", 3),
        ("a", BRAVO, "m1", 4),
        ("b", ALPHA, "m1", 2),
        ("b", BRAVO, "m2", 3),
    ]
    try:
        for node_id, token, model, n in plan:
            ks = [os.urandom(16) for _ in range(n)]
            server: ServerProcess = cl.servers[node_id]
            with server.client(token, namespace=Namespace(model, LAYOUT)) as c:
                assert c.batch_put(ks, [_value(i) for i in range(n)]) == [True] * n
            scope = principal_of(token)
            want.setdefault((token.tenant, model), set()).update(
                (scope.scope(k).hex(), node_id) for k in ks
            )

        def ls(*flags: str) -> set[tuple[str, str]]:
            doc = cli_json(capsys, "ls", *where, "--token", ADMIN.token, "--limit", "0", *flags)
            assert doc["errors"] == [] and doc["more"] == []
            assert all(e["tier"] == "dram" and e["size"] > 512 for e in doc["entries"])
            assert doc["total"] == len(doc["entries"])
            for e in doc["entries"]:  # each row names its namespace
                assert (e["key"], e["node"]) in want[(e["tenant"], e["namespace"])]
            return {(e["key"], e["node"]) for e in doc["entries"]}

        assert ls("--namespace", "m1", "--tenant", "alpha") == want[("alpha", "m1")]
        assert ls("--model", "m1") == want[("alpha", "m1")] | want[("bravo", "m1")]
        assert ls("--tenant", "bravo") == want[("bravo", "m1")] | want[("bravo", "m2")]
        assert ls("--tenant", "bravo", "--node", "b") == want[("bravo", "m2")]
        assert ls("--tenant", "alpha", "--namespace", "m2", "--tier", "ssd") == set()
        assert ls("--tenant", "nobody") == set() and ls("--namespace", "m3") == set()
        first = sorted(want[("alpha", "m2")])[0]
        assert ls("--tenant", "alpha", "--prefix", first[0][:9]) == {first}  # odd digits too

        monkeypatch.setenv("KVSTORE_TOKEN", ADMIN.token)  # the token as evict takes it
        doc = cli_json(capsys, "ls", *where, "--tenant", "alpha", "--limit", "2")
        assert doc["total"] == 10 and len(doc["entries"]) == 2
        assert cli_json(capsys, "ls", *where, "--limit", "0")["total"] == 17  # directory
        capsys.readouterr()
        assert main(["ls", *where, "--namespace", "m1"]) == 0
        out = capsys.readouterr().out
        assert "namespace m1: 11 of 11 blocks" in out, out
        assert max(len(line) for line in out.splitlines()) <= 80
        assert main(["ls", *where, "--tenant", "alpha", "--token", ALPHA.token]) == 1
        assert "needs an admin token" in capsys.readouterr().err
    finally:
        stop(cl)


def test_ls_by_namespace_finds_blocks_a_drain_moved(
    etcd_server: EtcdProcess,
    cluster_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Node b learns the names of the namespaces it imports, from a, not from any
    client using them on b; they are kept beside its SSD tier across a restart."""
    cl = two_nodes(etcd_server, cluster_name, tmp_path)
    a, b = cl.servers["a"], cl.servers["b"]
    where = ("--etcd", cl.etcd, "--cluster", cl.name, "--token", ADMIN.token, "--limit", "0")
    want: dict[tuple[str, str], set[str]] = {}
    try:
        for token, model, n in ((ALPHA, "m1", 4), (ALPHA, "m2", 2), (BRAVO, "m1", 3)):
            ks = [os.urandom(16) for _ in range(n)]
            with a.client(token, namespace=Namespace(model, LAYOUT)) as c:
                assert c.batch_put(ks, [_value(i) for i in range(n)]) == [True] * n
            want[(token.tenant, model)] = {principal_of(token).scope(k).hex() for k in ks}
        with a.client(ADMIN) as c:
            AdminClient(c).evict("dram", 4 * 1024)  # some on a's SSD, some in its DRAM
            assert 0 < c.stats()["tiers"]["ssd"]["blocks"] < 9

        def ls(*flags: str) -> set[tuple[str, str]]:
            doc = cli_json(capsys, "ls", *where, *flags)
            assert doc["errors"] == [] and doc["more"] == []
            return {(e["key"], e["node"]) for e in doc["entries"]}

        def on(node: str, *scopes: tuple[str, str]) -> set[tuple[str, str]]:
            return {(k, node) for s in scopes for k in want[s]}

        assert ls("--tenant", "alpha") == on("a", ("alpha", "m1"), ("alpha", "m2"))
        assert main(["drain", a.address, "--to", b.address, "--token", ADMIN.token]) == 0
        capsys.readouterr()
        assert ls("--namespace", "m1", "--tenant", "alpha") == on("b", ("alpha", "m1"))
        assert ls("--namespace", "m1") == on("b", ("alpha", "m1"), ("bravo", "m1"))
        assert ls("--tenant", "alpha") == on("b", ("alpha", "m1"), ("alpha", "m2"))

        with b.client(ADMIN) as c:  # to b's SSD, then a restart reloads them from there
            AdminClient(c).evict("dram", 0)
        b.restart()
        assert ls("--tenant", "bravo", "--tier", "ssd") == on("b", ("bravo", "m1"))
        assert ls("--namespace", "m2") == on("b", ("alpha", "m2"))
    finally:
        stop(cl)
