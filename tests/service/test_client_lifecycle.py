"""Client lifecycle, timeouts, retries and reconnection, against real server processes;
what is the client's own logic runs on the in-memory network too
(tests/support/memory_fixtures.py), in the hermetic run."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import numpy as np
import pytest
import torch

from kvstore import AsyncStoreClient, StoreClient
from kvstore.client.admin import AdminClient
from kvstore.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    LayoutMismatch,
    TimeoutError_,
    Unavailable,
)
from tests.support.memory_fixtures import Served, reach
from tests.support.server_process import ADMIN, ALPHA, ServerProcess


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") + b"lifecycle..."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unopened_open_closed(any_server: Served) -> None:
    c = StoreClient(any_server.address, token=ALPHA.token, **reach(any_server))
    assert c.state == "unopened"
    with pytest.raises(ClosedError, match="not open"):
        c.exists([_key(0)])
    c.open()
    assert c.state == "open" and c.open() is c  # opening an open client is harmless
    assert c.exists([_key(0)]) == [False]
    c.close()
    c.close()  # idempotent
    assert c.state == "closed"
    with pytest.raises(ClosedError, match="is closed"):
        c.get(_key(0))
    with pytest.raises(ClosedError, match="create a new one"):
        c.open()


def test_context_manager_and_server_info(any_server: Served) -> None:
    with StoreClient(any_server.address, token=ALPHA.token, **reach(any_server)) as c:
        assert c.state == "open"
        info = c.server_info
        assert info["tenant"] == "alpha" and not info.get("admin", False)
        assert info["limits"]["max_batch"] > 0
        assert c.health() == "serving"
    assert c.state == "closed"


def test_bad_address_and_settings_fail_before_connecting() -> None:
    with pytest.raises(ConfigError, match="address"):
        StoreClient("127.0.0.1:notaport")
    with pytest.raises(ConfigError, match="transport"):
        StoreClient("127.0.0.1:7400", transport="carrier-pigeon")


def test_unreachable_server_is_unavailable_within_the_connect_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises((Unavailable, TimeoutError_)):
        StoreClient.connect(f"127.0.0.1:{_free_port()}", token="x" * 16, connect_timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_errors_that_retrying_cannot_fix_are_raised_at_once(any_server: Served) -> None:
    with pytest.raises(AuthError):
        StoreClient.connect(
            any_server.address, token="not-a-real-token-at-all", **reach(any_server)
        )
    with any_server.client(ALPHA) as c:
        c.put(_key(1), np.zeros(8, dtype=np.float32))
        with pytest.raises(LayoutMismatch):
            c.get_into(_key(1), np.zeros(8, dtype=np.int32))
        assert c.counters.get("retries") == 0


def test_deadline_passed_is_a_timeout(store_server: ServerProcess) -> None:
    """The data socket refuses a call whose deadline has passed (not the in-memory
    network's concern: it has no socket to wait on)."""
    with store_server.client(ALPHA) as c, pytest.raises(TimeoutError_):
        c.exists([_key(2)], timeout=0)


def test_async_client(any_server: Served) -> None:
    async def main() -> None:
        async with AsyncStoreClient(
            any_server.address, token=ALPHA.token, **reach(any_server)
        ) as c:
            assert c.state == "open"
            blocks = [torch.full((4, 16), float(i), dtype=torch.bfloat16) for i in range(8)]
            keys = [_key(100 + i) for i in range(8)]
            assert await c.batch_put(keys, blocks) == [True] * 8
            outs = [torch.empty(4, 16, dtype=torch.bfloat16) for _ in range(8)]
            hits = await asyncio.gather(
                *(c.get_into(k, o) for k, o in zip(keys, outs, strict=True))
            )
            assert all(hits) and all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
            assert await c.match_prefix(keys) == 8
            assert await c.remove(keys) == 8
            assert (await c.stats())["node_id"]
        assert c.state == "closed"
        with pytest.raises(ClosedError):
            await c.exists(keys)

    asyncio.run(main())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["clean", "crash"])
def test_restart_while_connected_serves_ssd_blocks_again(server_factory, sig: int) -> None:
    server = server_factory(lease_ttl_s=5)
    blocks = [torch.randn(2, 2, 2, 4, 8).to(torch.bfloat16) for _ in range(4)]
    keys = [_key(200 + i) for i in range(4)]
    clients = [server.client(ALPHA, transport=t, timeout_s=20) for t in ("shm", "tcp")]
    try:
        assert clients[0].batch_put(keys, blocks) == [True] * 4
        with server.client(ADMIN) as admin:
            AdminClient(admin).evict("dram", 0)  # push everything down to the SSD tier
        assert clients[1].stats()["tiers"]["ssd"]["blocks"] >= 4
        old_segment = server.facts["shm_name"]

        server.restart(sig)  # the clients stay open across the restart

        assert server.facts["shm_name"] != old_segment
        for c in clients:
            outs = [torch.empty_like(b) for b in blocks]
            assert c.batch_get_into(keys, outs) == [True] * 4
            assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
            assert c.put(_key(300 + int(sig)), blocks[0]) in (True, False)
        assert clients[0].transport == "shm" and clients[1].transport == "tcp"
        pool = clients[0]._pool
        assert pool is not None  # the shm client found the new server's Unix socket
        assert pool._idle[-1][0].fs.sock.family == socket.AF_UNIX
    finally:
        for c in clients:
            c.close()
