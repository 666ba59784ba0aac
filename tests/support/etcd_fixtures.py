"""A real etcd for the directory tests, on free 127.0.0.1 ports with data in tmp.

Use from a test module with ``pytest_plugins = ["tests.support.etcd_fixtures"]``:

- ``etcd_server``: one etcd per test module (tests isolate by cluster name, see
  ``cluster_name``), stopped by PID at the end;
- ``etcd_private``: a fresh etcd for one test, for tests that restart or crash it
  (``etcd_private.restart(down_for=1.0, crash=True)``).

Tests using them are skipped, with the reason, only when no etcd binary exists.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.directory.etcd_process import EtcdProcess, etcd_binary

__all__ = ["EtcdProcess", "cluster_name", "etcd_private", "etcd_server", "require_etcd"]

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
