"""Fixtures that run real ``kvstore serve`` processes (see tests/server_process.py).

Use from a test module with ``pytest_plugins = ["tests.support.server_fixtures"]``:

- ``store_server``: one server per test module (three tenants, see TOKENS; DRAM + SSD
  in tmp), stopped by its PID at the end;
- ``server_factory``: ``server_factory(lease_ttl_s=0.3, ...)`` starts a server with
  custom flags inside a test; every one it started is stopped (by PID) at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.wire.ucx import available as ucx_available
from tests.support.server_process import ServerProcess, base_flags

__all__ = ["DATA_PATHS", "ServerFactory", "serve_every_path", "server_factory", "store_server"]

DATA_PATHS = ("shm", "tcp", "ucx") if ucx_available() else ("shm", "tcp")
"""The client transports a same-host test can take: UCX where ucxx is installed."""


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server shared by a module's tests (tests isolate by key)."""
    workdir = tmp_path_factory.mktemp("server")
    server = ServerProcess(workdir, base_flags(workdir)).start()
    try:
        yield server
    finally:
        server.stop()


def serve_every_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The body of a module's ``store_server`` fixture whose tests run over every data
    path: the shared server's flags, offering UCX where it can."""
    workdir = tmp_path_factory.mktemp("server")
    flags = base_flags(workdir)
    if "ucx" in DATA_PATHS:
        flags["transport"] = "ucx"
    server = ServerProcess(workdir, flags).start()
    try:
        yield server
    finally:
        server.stop()


class ServerFactory:
    """Starts servers for one test and stops them all at its end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[ServerProcess] = []

    def __call__(self, env: dict[str, str] | None = None, **flags: Any) -> ServerProcess:
        workdir = self.root / f"server{len(self.started)}"
        workdir.mkdir()
        merged = {**base_flags(workdir), **flags}
        server = ServerProcess(workdir, merged, env)
        self.started.append(server)
        return server.start()

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """``server_factory(lease_ttl_s=0.3, ...)`` -> a started ServerProcess."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
