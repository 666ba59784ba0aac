"""Layer-by-layer writes (``NodeClient.begin_layers``) against a real server, over every
data path: shared memory, TCP and, where ucxx is installed, UCX.

The contract under test (kvstore/client/layered.py): the stored block is the one a whole
put of the same bytes stores; nothing is visible before the commit; withdrawn items and
aborted writes store nothing and free their space; bad input is a clear error. That
contract holds on the in-memory network too (tests/support/memory_fixtures.py): its
case runs in the hermetic run; a killed or stalled writer needs a real socket.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.errors import CorruptBlock, InvalidValue, KVStoreError, ReservationError
from tests.support.memory_fixtures import Served, reach, serving
from tests.support.server_fixtures import DATA_PATHS, ServerFactory, serve_every_path
from tests.support.server_process import ALPHA, ServerProcess
from tests.support.waiting import wait_until

NS = Namespace("layered-llama", "bf16:L4:H2:D8", tenant="ignored-by-the-server")
SHAPE = (4, 2, 2, 16, 8)  # layers, K/V, kv heads, tokens, head dim
_seq = itertools.count()

TRANSPORTS = DATA_PATHS


def fresh_keys(n: int) -> list[bytes]:
    base = next(_seq)
    return prefix_keys(list(range(base * 1000, base * 1000 + 16 * n)), 16, NS)


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE, generator=g).to(torch.bfloat16)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server, offering UCX where it can."""
    yield from serve_every_path(tmp_path_factory)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("memory", ""), id="memory"),
        *(pytest.param(("process", t), marks=pytest.mark.process, id=t) for t in TRANSPORTS),
    ],
)
def path(request: pytest.FixtureRequest) -> tuple[Served, str]:
    """The server (in memory, or the real one) and the writer's transport on it."""
    kind, transport = request.param
    return serving(request, kind), transport


@pytest.fixture(scope="module")
def client(path: tuple[Served, str]) -> Iterator[StoreClient]:
    server, transport = path
    with server.client(ALPHA, transport=transport, namespace=NS) as c:
        yield c


@pytest.fixture(scope="module")
def reader(path: tuple[Served, str]) -> Iterator[StoreClient]:
    """A second client on TCP: what other processes see."""
    with path[0].client(ALPHA, transport="tcp", namespace=NS) as c:
        yield c


def _dram_used(c: StoreClient) -> int:
    return int(c.stats()["tiers"]["dram"]["used"])


def test_layer_by_layer_stores_the_block_a_whole_put_stores(
    client: StoreClient, reader: StoreClient
) -> None:
    keys, data = fresh_keys(3), blocks(3, 1)
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        for layer in range(SHAPE[0]):
            w.write(layer, [data[i, layer : layer + 1] for i in range(3)])
            if layer == 0:  # the first layer has reached the server: still invisible
                assert reader.exists(keys) == [False] * 3
        assert w.commit() == [True] * 3
    assert reader.exists(keys) == [True] * 3
    for i, k in enumerate(keys):
        got = reader.get(k)
        assert isinstance(got, torch.Tensor) and torch.equal(got, data[i])
        assert client.put(k, data[i]) is False  # the same content, the same key: present
    out = torch.empty(2, *SHAPE[1:], dtype=torch.bfloat16)  # ranged reads see the layers
    assert reader.get_into(keys[1], out, layers=(2, 4)) is True
    assert torch.equal(out, data[1, 2:4])


def test_ranges_of_layers_and_stored_keys(client: StoreClient) -> None:
    keys, data = fresh_keys(2), blocks(2, 2)
    assert client.put(keys[0], data[0]) is True
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        w.write(0, [data[0, 0:3], data[1, 0:3]])
        w.write(3, [data[0, 3:4], data[1, 3:4]])
        assert w.written == 4
        assert w.commit() == [False, True]
    assert torch.equal(client.get(keys[1]), data[1])


def test_stacked_layers_leave_as_they_lie(client: StoreClient, reader: StoreClient) -> None:
    """write_stacked: each layer of every block in one layer-major buffer (how the vLLM
    connector gathers a step's blocks) stores what per-block writes store."""
    keys, data = fresh_keys(3), blocks(3, 7)
    stacked = data.transpose(0, 1).contiguous()  # (layers, blocks, ...)
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        w.write_stacked(0, stacked[0:1])
        w.write_stacked(1, stacked[1:4])
        assert w.commit() == [True] * 3
    for i, k in enumerate(keys):
        assert torch.equal(reader.get(k), data[i])
    with client.begin_layers(fresh_keys(3), shape=SHAPE, dtype=torch.bfloat16) as w:
        with pytest.raises(InvalidValue, match="stacked layers"):
            w.write_stacked(0, stacked[0:1, :2])  # two blocks' worth for three keys
        with pytest.raises(InvalidValue, match="layers"):
            w.write_stacked(0, torch.cat([stacked, stacked[:1]]))


def test_withdrawn_items_are_not_stored(client: StoreClient, reader: StoreClient) -> None:
    keys, data = fresh_keys(3), blocks(3, 3)
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        for layer in range(4):
            w.write(layer, [data[i, layer : layer + 1] for i in range(3)])
        assert w.commit(keep=[True, False, True]) == [True, None, True]
    assert reader.exists(keys) == [True, False, True]


def test_abort_stores_nothing_and_frees_the_space(client: StoreClient, reader: StoreClient) -> None:
    used = _dram_used(reader)
    keys, data = fresh_keys(4), blocks(4, 4)
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        w.write(0, [data[i, :2] for i in range(4)])
        wait_until(lambda: _dram_used(reader) > used, "reserved for the whole write")
    # left without a commit: aborted
    wait_until(lambda: _dram_used(reader) == used, within=5.0, what="space freed")
    assert reader.exists(keys) == [False] * 4
    assert client.put(keys[0], data[0]) is True  # the client goes on (a new connection)


def test_bad_input_is_refused_before_anything_is_stored(client: StoreClient) -> None:
    keys, data = fresh_keys(2), blocks(2, 5)
    with pytest.raises(InvalidValue, match="dtype"):
        client.begin_layers(keys, shape=SHAPE, dtype="complex64")
    with client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
        with pytest.raises(InvalidValue, match="layer 1 written after"):
            w.write(1, [data[0, 1:2], data[1, 1:2]])
        with pytest.raises(InvalidValue, match="float32"):
            w.write(0, [data[0, :1].float(), data[1, :1].float()])
        with pytest.raises(InvalidValue, match="1 values for 2 keys"):
            w.write(0, [data[0, :1]])
        with pytest.raises(InvalidValue, match="layers"):
            w.write(0, [data[0, :1], data[1, :2]])
        w.write(0, [data[0, :2], data[1, :2]])
        with pytest.raises(InvalidValue, match="commit after layers"):
            w.commit()
        w.abort()
        with pytest.raises(ReservationError):
            w.write(2, [data[0, 2:], data[1, 2:]])
    assert client.exists(keys) == [False, False]


def test_a_block_that_does_not_match_the_namespace_is_refused(client: StoreClient) -> None:
    keys = fresh_keys(1)
    bad = (4, 2, 2, 16, 4)  # the layout's head dim is 8
    with client.begin_layers(keys, shape=bad, dtype=torch.bfloat16) as w:
        for layer in range(4):
            w.write(layer, [torch.zeros(1, *bad[1:], dtype=torch.bfloat16)])
        (r,) = w.commit()
    assert isinstance(r, Exception) and "shape" in str(r)
    assert client.exists(keys) == [False]


def test_a_wrong_checksum_stores_nothing(client: StoreClient) -> None:
    """A writer whose bytes do not match its checksum (a hostile or broken client)
    gets an error for that item; the server stores nothing of it."""
    keys, data = fresh_keys(2), blocks(2, 6)
    w = client.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16)
    for layer in range(4):
        w.write(layer, [data[i, layer : layer + 1] for i in range(2)])
    w._sums[0].update(b"not what was sent")
    r0, r1 = w.commit()
    assert isinstance(r0, CorruptBlock) and r1 is True
    assert client.exists(keys) == [False, True]


_WRITER = """
import sys, time, torch
from kvstore import Namespace, StoreClient, prefix_keys
ns = Namespace("layered-llama", "bf16:L4:H2:D8")
keys = prefix_keys(list(range(900000, 900064)), 16, ns)
with StoreClient.connect(sys.argv[1], token=sys.argv[2], namespace=ns, transport=sys.argv[3]) as c:
    w = c.begin_layers(keys, shape=(4, 2, 2, 16, 8), dtype=torch.bfloat16)
    w.write(0, [torch.ones(1, 2, 2, 16, 8, dtype=torch.bfloat16)] * 4)
    print("written", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_writer_killed_mid_stream_leaves_nothing(
    store_server: ServerProcess, transport: str
) -> None:
    with store_server.client(ALPHA, transport="tcp", namespace=NS) as reader:
        _killed_writer_leaves_nothing(store_server, reader, transport)


def _killed_writer_leaves_nothing(
    store_server: ServerProcess, reader: StoreClient, transport: str
) -> None:
    used = _dram_used(reader)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, store_server.address, ALPHA.token, transport],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        wait_until(lambda: _dram_used(reader) > used, "reserved")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        wait_until(lambda: _dram_used(reader) == used, within=10.0, what="space freed")
        assert time.monotonic() - t0 < 10.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    keys = prefix_keys(list(range(900000, 900064)), 16, NS)
    assert reader.exists(keys) == [False] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_writer_that_stalls_between_layers_is_cut(
    server_factory: ServerFactory, transport: str
) -> None:
    """A writer that sends layer 0 and then nothing (a hung engine) holds its
    reservations only for put_grace_s (the socket's FILL lease, the shared-memory
    write lease): then the server frees them and stores nothing."""
    flags = {"put_grace_s": 0.5, "lease_ttl_s": 1.0}
    if transport == "ucx":
        flags["transport"] = "ucx"
    server = server_factory(**flags)
    keys, data = fresh_keys(2), blocks(2, 8)
    with (
        server.client(ALPHA, namespace=NS, transport=transport) as c,
        server.client(ALPHA, namespace=NS, transport="tcp") as watcher,
    ):
        used = _dram_used(watcher)
        w = c.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16)
        w.write(0, [data[0, :1], data[1, :1]])
        # the socket write has left; the server reserves once it reads the header
        wait_until(lambda: _dram_used(watcher) > used, "reserved", within=5.0)
        wait_until(lambda: _dram_used(watcher) == used, "stalled write freed", within=10.0)
        with contextlib.suppress(KVStoreError):  # too late: an error, or nothing stored
            w.write(1, [data[0, 1:2], data[1, 1:2]])
            w.write(2, [data[0, 2:], data[1, 2:]])
            assert not any(r is True for r in w.commit())
        assert watcher.exists(keys) == [False, False]
        assert c.put(keys[0], data[0]) is True  # the client goes on


def test_the_async_client_writes_layer_by_layer(any_server: Served) -> None:
    """AsyncStoreClient.begin_layers: the same write with coroutine steps; leaving
    ``async with`` without a commit stores nothing."""
    import asyncio

    from kvstore import AsyncStoreClient

    t = blocks(2, seed=41)
    *keys, dropped_key = fresh_keys(3)
    dropped = [dropped_key]

    async def write() -> list[object]:
        ac = await AsyncStoreClient.connect(
            any_server.address, token=ALPHA.token, namespace=NS, **reach(any_server)
        )
        try:
            async with await ac.begin_layers(keys, shape=SHAPE, dtype=torch.bfloat16) as w:
                for layer in range(SHAPE[0]):
                    await w.write(layer, [b[layer : layer + 1] for b in t])
                results = await w.commit()
            async with await ac.begin_layers(dropped, shape=SHAPE, dtype=torch.bfloat16) as w:
                await w.write(0, [t[0][0:1]])
            return results
        finally:
            await ac.close()

    assert asyncio.run(write()) == [True, True]
    with any_server.client(ALPHA, transport="tcp", namespace=NS) as reader:
        for k, b in zip(keys, t, strict=True):
            got = reader.get(k)
            assert got is not None and torch.equal(got, b)
        assert reader.exists(dropped) == [False]
