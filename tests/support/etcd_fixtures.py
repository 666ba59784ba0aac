"""A real etcd for the directory tests, on free 127.0.0.1 ports with data in tmp.

Use from a test module with ``pytest_plugins = ["tests.support.etcd_fixtures"]``:

- ``etcd_server``: one etcd per test module (tests isolate by cluster name, see
  ``cluster_name``), stopped by PID at the end;
- ``etcd_private``: a fresh etcd for one test, for tests that restart or crash it
  (``etcd_private.restart(down_for=1.0, crash=True)``);
- ``etcd_locked``: one etcd per module with auth enabled: a root user and a user whose
  role reaches only the cluster ``LOCKED_CLUSTER`` (see :class:`LockedEtcd`);
- ``etcd_tls``: one etcd per module that serves clients over TLS only and requires a
  client certificate signed by the test CA (see :class:`TlsEtcd`).

Tests using them are skipped, with the reason, only when no etcd binary exists.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.config import EtcdAuth
from kvstore.directory.etcd_process import EtcdProcess, EtcdTLS, EtcdUser, etcd_binary

__all__ = [
    "LOCKED_CLUSTER",
    "EtcdProcess",
    "LockedEtcd",
    "TlsEtcd",
    "cluster_name",
    "etcd_locked",
    "etcd_private",
    "etcd_server",
    "etcd_tls",
    "require_etcd",
]

LOCKED_CLUSTER = "locked"

_seq = itertools.count()


def require_etcd() -> str:
    """The etcd binary, or skip the calling test with the reason."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd binary not found (apt-get install etcd-server, or put etcd on PATH)")
    return binary


def _start(data_dir: Path) -> EtcdProcess:
    return EtcdProcess(data_dir, binary=require_etcd()).start()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One healthy etcd shared by the tests of a module."""
    server = _start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_private(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A healthy etcd of this test's own, which it may stop, kill or restart."""
    server = _start(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name no other test uses (keys of different clusters never meet)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:48]
    return f"{base}-{next(_seq)}"


@dataclass
class LockedEtcd:
    """An etcd with auth on. ``user`` may read and write only under LOCKED_CLUSTER's
    prefix; ``root`` is etcd's admin; ``other`` may reach only cluster "elsewhere"."""

    process: EtcdProcess
    user: EtcdAuth
    root: EtcdAuth
    other: EtcdAuth

    @property
    def endpoint(self) -> str:
        return self.process.endpoint


@pytest.fixture(scope="module")
def etcd_locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LockedEtcd]:
    """One etcd with auth enabled, shared by a module's tests."""
    pytest.importorskip("aetcd")
    server = _start(tmp_path_factory.mktemp("etcd-locked"))
    try:
        users = [
            EtcdUser("kvstore-node", "node-password-0123", f"/kvstore/{LOCKED_CLUSTER}/".encode()),
            EtcdUser("other-team", "other-password-0123", b"/kvstore/elsewhere/"),
        ]
        server.enable_auth("root-password-0123", users)
        yield LockedEtcd(
            server,
            user=EtcdAuth(user="kvstore-node", password="node-password-0123"),
            root=EtcdAuth(user="root", password="root-password-0123"),
            other=EtcdAuth(user="other-team", password="other-password-0123"),
        )
    finally:
        server.stop()


@dataclass
class TlsEtcd:
    """An etcd that speaks TLS only and wants a client certificate: ``client`` is the
    EtcdAuth that reaches it; ``ca`` the CA file; ``stranger`` a client certificate
    from another CA."""

    process: EtcdProcess
    client: EtcdAuth
    ca: str
    stranger: EtcdAuth

    @property
    def endpoint(self) -> str:
        return self.process.endpoint


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    """One etcd serving TLS with client-certificate auth, shared by a module's tests."""
    pytest.importorskip("cryptography")
    from tests.support.tls_ca import TestCA

    root = tmp_path_factory.mktemp("etcd-tls")
    ca = TestCA.create(root / "ca")
    cert, key = ca.issue("etcd-server", server=True)
    client_cert, client_key = ca.issue("kvstore-client", server=False)
    other = TestCA.create(root / "other-ca", cn="another-ca")
    stranger_cert, stranger_key = other.issue("stranger", server=False)
    tls = EtcdTLS(ca.cert, cert, key, client_cert, client_key)
    server = EtcdProcess(root / "etcd", binary=require_etcd(), tls=tls).start()
    try:
        yield TlsEtcd(
            server,
            client=EtcdAuth(ca=str(ca.cert), cert=str(client_cert), key=str(client_key)),
            ca=str(ca.cert),
            stranger=EtcdAuth(ca=str(ca.cert), cert=str(stranger_cert), key=str(stranger_key)),
        )
    finally:
        server.stop()
