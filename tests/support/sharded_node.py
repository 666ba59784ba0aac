"""A sharded node in this process: the N shard servers ``kvstore serve --shards N`` runs,
as StoreServer objects on one event-loop thread (hermetic: no process is started).

Each shard is configured as the supervisor configures its process (kvstore/server/
shards.py, ``ShardPlan.flags``: 1/N of DRAM and SSD, its own SSD directory and node id,
its ShardRole), from ``kvstore serve`` flags (``base_flags`` by default: the three test
tenants with a scope secret); and, as the supervisor does, shards 1..N-1 start first,
then shard 0 with every shard's address. :meth:`ShardedNode.stop_shard` and
:meth:`ShardedNode.start_shard` take one shard down and bring it back on its ports, as a
crash and the supervisor's restart would.

Fixtures (registered in tests/conftest.py):

- ``sharded_node``: a 2-shard node shared by a module's tests (tests isolate by key);
- ``sharded_factory``: ``sharded_factory(shards=3, tokens_file=...)`` within a test;
  every node it started is stopped at teardown.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import StoreClient
from kvstore.server.serve import StoreServer, load_configs
from kvstore.server.shards import ShardPlan
from kvstore.wire.shards import ShardPeer, ShardRole, shard_name
from tests.support.server_process import ALPHA, Token, base_flags

__all__ = ["ShardedFactory", "ShardedNode", "sharded_factory", "sharded_node"]

START_TIMEOUT_S = 60.0


def _text(flags: dict[str, Any]) -> dict[str, str | None]:
    return {k: None if v is None else str(v) for k, v in flags.items()}


class ShardedNode:
    """``shards`` StoreServer shards of node ``group`` (see the module docstring)."""

    def __init__(
        self, workdir: Path, shards: int = 2, group: str = "sharded", **flags: Any
    ) -> None:
        merged = {**base_flags(workdir), "node_id": group, "max_value_bytes": "4MiB", **flags}
        node, config = load_configs(_text(merged), env={})
        self.group = group
        self.plan = ShardPlan(node, config, shards, _text(merged))
        self.servers: list[StoreServer | None] = [None] * shards
        self.ports: list[tuple[int, int]] = [(0, 0)] * shards
        self.peers: tuple[ShardPeer, ...] = ()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def count(self) -> int:
        return self.plan.count

    @property
    def address(self) -> str:
        """Where users dial the node: shard 0."""
        return f"127.0.0.1:{self.ports[0][0]}"

    def server(self, index: int) -> StoreServer:
        srv = self.servers[index]
        assert srv is not None, f"shard {index} is stopped"
        return srv

    def start(self) -> ShardedNode:
        """Shards 1..N-1, then shard 0 told where they are."""
        self._thread.start()
        try:
            for i in range(1, self.count):
                self.start_shard(i)
            self.peers = tuple(
                ShardPeer(i, self.plan.address(self.ports[i][0]), shard_name(self.group, i))
                for i in range(self.count)
            )
            self.start_shard(0)
        except BaseException:
            self.stop()
            raise
        return self

    def start_shard(self, index: int) -> StoreServer:
        """Start shard ``index`` (again: on the ports it had, as the supervisor does)."""
        flags = self.plan.flags(index, self.ports[index], self.peers)
        node, config = load_configs(_text(flags), env={})
        role = ShardRole.from_json(flags["shard_role"])
        srv = StoreServer(node.replace(warm=False), config, role)
        self._run(srv.start())
        self.servers[index] = srv
        self.ports[index] = (srv.port, srv.data_port)
        return srv

    def stop_shard(self, index: int) -> None:
        """Stop shard ``index`` (its DRAM is gone, as after a crash)."""
        srv, self.servers[index] = self.servers[index], None
        if srv is not None:
            self._run(srv.stop(grace=0.2))

    def stop(self) -> None:
        """Stop every shard and the loop; idempotent."""
        if self._thread.is_alive():
            for i in range(self.count):
                self.stop_shard(i)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(START_TIMEOUT_S)

    def client(self, token: Token | str | None = ALPHA, **kwargs: Any) -> StoreClient:
        """An open client of the node (through shard 0)."""
        tok = token.token if isinstance(token, Token) else token
        kwargs.setdefault("timeout_s", 10.0)
        kwargs.setdefault("connect_timeout_s", 10.0)
        return StoreClient.connect(self.address, token=tok, **kwargs)

    def shard_blocks(self, index: int) -> int:
        """Blocks shard ``index`` holds, read from its node directly."""
        node = self.server(index).node
        assert node is not None
        return int(node.stats()["blocks"])


class ShardedFactory:
    """Starts sharded nodes for one test and stops them all at its end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[ShardedNode] = []

    def __call__(self, shards: int = 2, **flags: Any) -> ShardedNode:
        workdir = self.root / f"sharded{len(self.started)}"
        workdir.mkdir()
        node = ShardedNode(workdir, shards, **flags)
        self.started.append(node)
        return node.start()

    def stop_all(self) -> None:
        for node in self.started:
            node.stop()


@pytest.fixture(scope="module")
def sharded_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardedNode]:
    """A 2-shard node shared by a module's tests."""
    node = ShardedNode(tmp_path_factory.mktemp("sharded")).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def sharded_factory(tmp_path: Path) -> Iterator[ShardedFactory]:
    """``sharded_factory(shards=2, **serve_flags)`` -> a started ShardedNode."""
    factory = ShardedFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
