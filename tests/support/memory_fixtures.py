"""Servers on the in-memory network (tests/support/memory_net.py) that stand in for a
``kvstore serve`` child wherever a test's subject is not the socket, and fixtures that
run one test body against both.

:class:`MemoryStore` answers what a test asks of a :class:`ServerProcess` (``address``,
``client(token, ...)``), and is configured from the same flags: ``load_configs`` turns
them into the node and server configs the real command would build, so a test's
tenants, scope secret, quotas, tier sizes and limits are the real server's. Only the
DRAM segment is left out: the in-memory network has no shared memory.

- ``memory_server``: one per test module, with ``base_flags`` (three tenants, DRAM + SSD);
- ``memory_factory``: ``memory_factory(dram_bytes="1MiB", ...)`` within a test;
- ``any_server`` / ``any_factory``: the same, parametrized over ``memory`` and
  ``process`` (a real ``kvstore serve``; that case alone is marked ``process``), so a
  logic test is written once and the hermetic run keeps its memory case;
- :func:`over` with :func:`serving` or :func:`factory_of`: the same for a test that
  also picks the real server's transport (the in-memory server runs once, having
  none to pick).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from kvstore import StoreClient
from kvstore.node.store import StoreNode
from kvstore.server.serve import load_configs
from tests.support.memory_net import MemoryNetwork, MemoryServer
from tests.support.server_process import ALPHA, Token, base_flags

__all__ = [
    "BOTH",
    "MemoryFactory",
    "MemoryStore",
    "Served",
    "any_factory",
    "any_server",
    "factory_of",
    "memory_factory",
    "memory_server",
    "over",
    "reach",
    "serving",
]

BOTH = ["memory", pytest.param("process", marks=pytest.mark.process)]
"""Parameters of a fixture that gives a test the in-memory server or a real one."""

_ports = itertools.count(7400)


class Served(Protocol):
    """What a test uses of a server, in memory or a real process."""

    @property
    def address(self) -> str: ...

    def client(self, token: Token | str | None = ALPHA, **kwargs: Any) -> StoreClient: ...


class MemoryStore:
    """One server configured from ``kvstore serve`` flags, alone on its own network."""

    def __init__(self, workdir: Path, flags: dict[str, Any]) -> None:
        args = {k: None if v is None else str(v) for k, v in flags.items()}
        node_config, config = load_configs(args, env={})
        node = StoreNode(node_config.replace(shared_dram=False))
        self.net = MemoryNetwork()
        self.server = self.net.add(
            MemoryServer(node, f"memory-{workdir.name}:{next(_ports)}", config)
        )
        self.workdir = workdir

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def node(self) -> StoreNode:
        return self.server.node

    def client(self, token: Token | str | None = ALPHA, **kwargs: Any) -> StoreClient:
        """An open client of this server (transport choices do not apply in memory)."""
        tok = token.token if isinstance(token, Token) else token
        for socket_only in ("transport", "shm_direct"):
            kwargs.pop(socket_only, None)
        kwargs.setdefault("timeout_s", 10.0)
        kwargs.setdefault("connect_timeout_s", 10.0)
        return StoreClient.connect(self.address, token=tok, connector=self.net, **kwargs)

    def close(self) -> None:
        self.net.close()


class MemoryFactory:
    """Starts in-memory servers for one test (``base_flags`` < the test's flags) and
    closes them all at its end, as ServerFactory does for processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[MemoryStore] = []

    def __call__(self, env: dict[str, str] | None = None, **flags: Any) -> MemoryStore:
        workdir = self.root / f"memory{len(self.started)}"
        workdir.mkdir()
        store = MemoryStore(workdir, {**base_flags(workdir), **flags})
        self.started.append(store)
        return store

    def close_all(self) -> None:
        for store in self.started:
            store.close()


@pytest.fixture(scope="module")
def memory_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryStore]:
    """One in-memory server shared by a module's tests (tests isolate by key)."""
    workdir = tmp_path_factory.mktemp("memory")
    store = MemoryStore(workdir, base_flags(workdir))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def memory_factory(tmp_path: Path) -> Iterator[MemoryFactory]:
    """``memory_factory(dram_bytes="1MiB", ...)`` -> a MemoryStore."""
    factory = MemoryFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture(scope="module", params=BOTH)
def any_server(request: pytest.FixtureRequest) -> Served:
    """The module's shared server: in memory, or the real ``store_server``."""
    name = "memory_server" if request.param == "memory" else "store_server"
    served: Served = request.getfixturevalue(name)
    return served


@pytest.fixture(params=BOTH)
def any_factory(request: pytest.FixtureRequest) -> Callable[..., Served]:
    """A server factory for one test: in memory, or ``server_factory``'s processes."""
    name = "memory_factory" if request.param == "memory" else "server_factory"
    factory: Callable[..., Served] = request.getfixturevalue(name)
    return factory


def over(*transports: str) -> list[Any]:
    """``(kind, transport)`` parameters for a test of both servers: the in-memory one
    once (it has no transports to choose), a real one over each of ``transports``."""
    return [
        pytest.param("memory", "", id="memory"),
        *(pytest.param("process", t, marks=pytest.mark.process, id=t) for t in transports),
    ]


def serving(request: pytest.FixtureRequest, kind: str) -> Served:
    """The module's shared server of ``kind`` (a test parametrized with :func:`over`)."""
    name = "memory_server" if kind == "memory" else "store_server"
    served: Served = request.getfixturevalue(name)
    return served


def factory_of(request: pytest.FixtureRequest, kind: str) -> Callable[..., Served]:
    """A server factory of ``kind`` for this test (one parametrized with :func:`over`)."""
    name = "memory_factory" if kind == "memory" else "server_factory"
    factory: Callable[..., Served] = request.getfixturevalue(name)
    return factory


def reach(served: Served) -> dict[str, Any]:
    """What a client constructor needs, beyond the address, to reach ``served``."""
    return {"connector": served.net} if isinstance(served, MemoryStore) else {}
