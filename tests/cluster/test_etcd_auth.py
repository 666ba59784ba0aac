"""The directory on an etcd that is locked down (issue 17): auth with a user whose role
reaches only its cluster's prefix, and TLS with client certificates. Real etcd
processes on loopback (tests/support/etcd_fixtures.py), no stand-ins.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.cli import main
from kvstore.config import ClientConfig, ClusterConfig, EtcdAuth, ServerConfig, resolve_config
from kvstore.directory import NodeInfo
from kvstore.directory.etcd_process import EtcdProcess, EtcdUser
from kvstore.errors import AuthError, ConfigError, PermissionDenied, Unavailable
from kvstore.events import BlockStored
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from tests.support.etcd_fixtures import LOCKED_CLUSTER, LockedEtcd, TlsEtcd, require_etcd
from tests.support.server_process import (
    ADMIN,
    ALPHA,
    BRAVO,
    ServerProcess,
    base_flags,
    principal_of,
)
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

from kvstore.directory.etcd import EtcdDirectory

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _round_trip(endpoint: str, cluster: str, auth: EtcdAuth | None) -> None:
    """Everything a node and a reader do: register under a lease, publish, keep the
    lease alive, list, read through the watch-fed mirror, deregister (revoke)."""
    key = os.urandom(16)
    async with EtcdDirectory(endpoint, cluster, auth=auth, timeout=5.0) as d:
        await d.register_node(NodeInfo("n1", "h1", "h1:7400"), ttl=2)
        mirror = await d.mirror()
        await d.publish("n1", [BlockStored(key, TierKind.DRAM, 10, b"")])
        await d.flush("n1")
        assert [n.node_id for n in await d.list_nodes()] == ["n1"]
        for _ in range(200):
            if mirror.replicas(key):
                break
            await asyncio.sleep(0.02)
        assert [r.node_id for r in mirror.replicas(key)] == ["n1"]
        await asyncio.sleep(1.5)  # past a keepalive (a streamed call, with the token too)
        assert [n.node_id for n in await d.list_nodes()] == ["n1"]


def test_the_right_password_reaches_the_cluster(etcd_locked: LockedEtcd) -> None:
    run(_round_trip(etcd_locked.endpoint, LOCKED_CLUSTER, etcd_locked.user))


@pytest.mark.parametrize(
    "auth, match",
    [
        (None, "auth enabled; set etcd_user"),
        (EtcdAuth(user="kvstore-node", password="wrong-password"), "check etcd_user"),
        (EtcdAuth(user="nobody", password="node-password-0123"), "check etcd_user"),
    ],
    ids=["missing", "wrong-password", "unknown-user"],
)
def test_wrong_or_missing_credentials_are_an_auth_error(
    etcd_locked: LockedEtcd, auth: EtcdAuth | None, match: str
) -> None:
    with pytest.raises(AuthError, match=match):
        run(EtcdDirectory(etcd_locked.endpoint, LOCKED_CLUSTER, auth=auth).open())


def test_a_role_reaches_only_its_own_prefix(etcd_locked: LockedEtcd) -> None:
    with pytest.raises(PermissionDenied, match="cluster prefix"):
        run(EtcdDirectory(etcd_locked.endpoint, LOCKED_CLUSTER, auth=etcd_locked.other).open())
    run(_round_trip(etcd_locked.endpoint, "elsewhere", etcd_locked.other))


@pytest.mark.process
def test_a_forgotten_token_is_renewed(tmp_path: Path) -> None:
    """etcd forgets an idle simple token after --auth-token-ttl (and all of them at a
    restart); the directory authenticates again instead of failing from then on."""
    etcd = EtcdProcess(
        tmp_path / "etcd", binary=require_etcd(), extra_flags=["--auth-token-ttl=1"]
    ).start()
    try:
        etcd.enable_auth("root-password-0123", [EtcdUser("u", "u-password-0123", b"/kvstore/t/")])
        auth = EtcdAuth(user="u", password="u-password-0123")

        async def scenario() -> None:
            async with EtcdDirectory(etcd.endpoint, "t", auth=auth, timeout=5.0) as d:
                await d.register_node(NodeInfo("n1", "h1", "h1:7400"), ttl=5)
                await asyncio.sleep(2.5)  # the token is gone now
                assert [n.node_id for n in await d.list_nodes()] == ["n1"]
                etcd.restart()  # so are all tokens
                assert [n.node_id for n in await d.list_nodes()] == ["n1"]

        run(scenario())
    finally:
        etcd.stop()


def test_etcd_settings_are_checked_at_load(tmp_path: Path) -> None:
    env = {"KVSTORE_ETCD_USER": "u"}
    with pytest.raises(ConfigError, match="etcd_user and etcd_password"):
        resolve_config(ClusterConfig, env=env)
    with pytest.raises(ConfigError, match="etcd_cert and etcd_key"):
        ClientConfig(etcd_cert=__file__)
    with pytest.raises(ConfigError, match="etcd_ca: no such file"):
        ServerConfig(allow_anonymous=True, etcd_ca=str(tmp_path / "missing.pem"))
    env["KVSTORE_ETCD_PASSWORD"] = "p"
    cfg = resolve_config(ClusterConfig, env=env)
    assert cfg.etcd_auth == EtcdAuth(user="u", password="p") and "'p'" not in repr(cfg)
    assert EtcdAuth().empty and not EtcdAuth(ca=__file__).empty and EtcdAuth(ca=__file__).tls


def test_tls_with_a_client_certificate(etcd_tls: TlsEtcd) -> None:
    run(_round_trip(etcd_tls.endpoint, "tls", etcd_tls.client))


@pytest.mark.parametrize(
    "auth",
    [None, "ca-only", "stranger"],
    ids=["plaintext", "no-client-cert", "cert-of-another-ca"],
)
def test_tls_refuses_clients_without_a_trusted_certificate(
    etcd_tls: TlsEtcd, auth: str | None
) -> None:
    chosen = {None: None, "ca-only": EtcdAuth(ca=etcd_tls.ca), "stranger": etcd_tls.stranger}
    d = EtcdDirectory(etcd_tls.endpoint, "tls", auth=chosen[auth], timeout=2.0)
    with pytest.raises(Unavailable):  # the handshake fails: gRPC cannot tell why
        run(d.open())


# -- a node, a cluster client and the admin commands on the locked etcd -------------------


@pytest.fixture(scope="module")
def locked_node(
    etcd_locked: LockedEtcd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A ``kvstore serve`` node of LOCKED_CLUSTER, given etcd's credentials through its
    environment (as ``kvstore up`` hands them over)."""
    workdir = tmp_path_factory.mktemp("locked-node")
    flags = {
        **base_flags(workdir),
        "node_id": "a",
        "etcd": etcd_locked.endpoint,
        "cluster": LOCKED_CLUSTER,
        "node_lease_ttl_s": 2,
    }
    env = {"KVSTORE_" + k.upper(): v for k, v in etcd_locked.user.settings().items()}
    server = ServerProcess(workdir, flags, env).start()
    try:
        yield server
    finally:
        server.stop()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_node_and_a_cluster_client_work_through_the_locked_etcd(
    etcd_locked: LockedEtcd, locked_node: ServerProcess
) -> None:
    ns = Namespace("locked-model", "uint8:L1:H1:D1")
    keys = prefix_keys(list(range(32)), 16, ns)
    values = [np.full((1, 2, 1, 16, 1), i, dtype=np.uint8) for i in range(len(keys))]
    creds = {"etcd_user": "kvstore-node", "etcd_password": "node-password-0123"}
    with StoreClient.from_etcd(
        etcd_locked.endpoint, cluster=LOCKED_CLUSTER, token=ALPHA.token, namespace=ns, **creds
    ) as c:
        assert c.batch_put(keys, values) == [True, True]
        scoped = principal_of(ALPHA).scope_all(keys)  # what the node publishes
        wait_until(lambda: all(c.mirror.replicas(k) for k in scoped), "blocks published", 5)
        assert c.match_prefix(keys) == 2
        outs = [np.empty_like(v) for v in values]
        assert c.batch_get_into(keys, outs) == [True, True]
        assert all(np.array_equal(o, v) for o, v in zip(outs, values, strict=True))
    # B reads the same directory, yet A's prompt is not where B can compute it to be.
    with StoreClient.from_etcd(
        etcd_locked.endpoint, cluster=LOCKED_CLUSTER, token=BRAVO.token, namespace=ns, **creds
    ) as b:
        assert b.match_prefix(keys) == 0
        assert b.members.principal() == principal_of(BRAVO)  # its own scope, from INFO
        guess = Principal(ALPHA.tenant).scope_all(keys)  # A's scope from A's public name
        assert not any(b.mirror.replicas(k) for k in guess)
        assert all(b.mirror.replicas(k) for k in scoped)  # yet A's entries are there
    with pytest.raises(AuthError, match="etcd_user"):
        StoreClient.from_etcd(etcd_locked.endpoint, cluster=LOCKED_CLUSTER, token=ALPHA.token)


def test_admin_commands_read_the_locked_etcd_with_credentials(
    etcd_locked: LockedEtcd,
    locked_node: ServerProcess,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    where = ("--etcd", etcd_locked.endpoint, "--cluster", LOCKED_CLUSTER, "--json")
    rc, _, err = _cli(capsys, "nodes", *where)
    assert rc == 1 and "etcd_user" in err, err  # no credentials: refused, and says why
    rc, _, err = _cli(capsys, "ls", *where, "--etcd-user", "kvstore-node")
    assert rc == 1, err  # a user without its password is a config error
    monkeypatch.setenv("KVSTORE_ETCD_PASSWORD", "wrong-password")
    rc, _, err = _cli(capsys, "nodes", *where, "--etcd-user", "kvstore-node")
    assert rc == 1 and "check etcd_user and etcd_password" in err, err

    monkeypatch.setenv("KVSTORE_ETCD_PASSWORD", "node-password-0123")
    rc, out, err = _cli(capsys, "nodes", *where, "--etcd-user", "kvstore-node")
    assert rc == 0, err
    assert "a" in [n["node_id"] for n in json.loads(out)["nodes"]]
    monkeypatch.setenv("KVSTORE_ETCD_USER", "kvstore-node")  # or all from the environment
    rc, out, err = _cli(capsys, "ls", *where, "--limit", "0")
    assert rc == 0, err
    # Asking the nodes themselves (--tenant) needs an admin token on top.
    rc, _, err = _cli(capsys, "ls", *where, "--tenant", "alpha", "--token", ALPHA.token)
    assert rc == 1 and "needs an admin token" in err, err
    rc, out, err = _cli(capsys, "ls", *where, "--tenant", "alpha", "--token", ADMIN.token)
    assert rc == 0 and json.loads(out)["errors"] == [], err


def test_kvstore_up_hands_etcd_credentials_to_its_nodes(
    etcd_locked: LockedEtcd, tmp_path: Path
) -> None:
    from kvstore.procs.local_cluster import LocalCluster

    with LocalCluster(
        1, etcd=etcd_locked.endpoint, cluster=LOCKED_CLUSTER, allow_anonymous=True,
        etcd_auth=etcd_locked.user, root=tmp_path / "up", node_lease_ttl_s=2,
    ) as cluster:  # fmt: skip
        node_id = cluster.nodes[0].node_id

        async def registered() -> list[str]:
            async with EtcdDirectory(
                etcd_locked.endpoint, LOCKED_CLUSTER, auth=etcd_locked.user
            ) as d:
                return [n.node_id for n in await d.list_nodes()]

        assert node_id in run(registered())


def test_serving_registry_uses_etcd_credentials(
    etcd_locked: LockedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers register and routers watch through the same credentials (here from the
    environment, as the worker and router processes get them)."""
    from engine.registry import WorkerRecord, WorkerRegistration, WorkerView

    record = WorkerRecord("w1", "both", "tiny", "http://127.0.0.1:1", {"model": "tiny"})

    async def scenario() -> None:
        reg = WorkerRegistration(etcd_locked.endpoint, LOCKED_CLUSTER, ttl=2)
        view = WorkerView(etcd_locked.endpoint, LOCKED_CLUSTER)
        await reg.start(record)
        try:
            await view.start(timeout=10)
            assert await view.wait_for(lambda w: "w1" in w, 5)
        finally:
            await view.stop()
            await reg.stop()
        with pytest.raises(AuthError):
            await WorkerRegistration(etcd_locked.endpoint, LOCKED_CLUSTER, auth=EtcdAuth()).start(
                record
            )

    for name, value in etcd_locked.user.settings().items():
        monkeypatch.setenv("KVSTORE_" + name.upper(), value)
    run(scenario())
