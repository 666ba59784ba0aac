"""The data paths against a real server: shared memory (same host), TCP and, where ucxx
is installed, UCX (the server offers it: ``--transport ucx``).

Every test runs once per transport; values are torch bf16 tensors, numpy arrays and
bytes, single and batched, and every byte read back is compared with what was written.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore.client.admin import AdminClient
from kvstore.errors import InvalidValue, LayoutMismatch
from tests.support.server_fixtures import DATA_PATHS, serve_every_path
from tests.support.server_process import ADMIN, ALPHA, ServerProcess
from tests.support.waiting import wait_until

NS = Namespace("tiny-llama", "bf16:L2:H2:D8", tenant="ignored-by-the-server")
_seq = itertools.count()


def fresh_keys(n: int) -> list[bytes]:
    """Keys no other test in the module uses."""
    base = next(_seq)
    return prefix_keys(list(range(base * 1000, base * 1000 + 4 * n)), 4, NS)


def kv_block(seed: int, head_dim: int = 8) -> torch.Tensor:
    """One block of NS's layout: [layers=2, 2, kv_heads=2, tokens=4, head_dim=8]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, 4, head_dim, generator=g).to(torch.bfloat16)


TRANSPORTS = DATA_PATHS


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server, offering UCX where it can."""
    yield from serve_every_path(tmp_path_factory)


@pytest.fixture(scope="module", params=TRANSPORTS)
def client(request: pytest.FixtureRequest, store_server: ServerProcess) -> Iterator[StoreClient]:
    with store_server.client(ALPHA, transport=request.param, namespace=NS) as c:
        yield c


def test_transport_is_the_one_asked_for(client: StoreClient) -> None:
    client.exists(fresh_keys(1))
    assert client.transport == client.config.transport


def test_torch_bf16_put_get_get_into(client: StoreClient) -> None:
    (k,) = fresh_keys(1)
    t = kv_block(1)
    assert client.put(k, t) is True
    assert client.put(k, t) is False  # keys name content: a second put is a no-op
    got = client.get(k)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, t)
    out = torch.empty_like(t)
    assert client.get_into(k, out) is True
    assert torch.equal(out, t)


@pytest.mark.parametrize("kind", ["numpy", "bytes"])
def test_other_value_kinds(store_server: ServerProcess, kind: str) -> None:
    for transport in TRANSPORTS:
        with store_server.client(ALPHA, transport=transport) as c:  # no namespace: any shape
            (k,) = fresh_keys(1)
            value: object
            if kind == "numpy":
                value = np.random.default_rng(3).standard_normal((3, 5, 7)).astype(np.float32)
            else:
                value = os.urandom(12345)
            assert c.put(k, value)
            got = c.get(k)
            if kind == "numpy":
                assert isinstance(got, np.ndarray) and got.dtype == np.float32
                np.testing.assert_array_equal(got, value)
                out = np.empty((3, 5, 7), dtype=np.float32)
            else:
                assert got == value
                out = bytearray(12345)
            assert c.get_into(k, out)
            assert bytes(memoryview(out).cast("B")) == bytes(memoryview(value).cast("B"))


def test_batches_report_per_key(client: StoreClient) -> None:
    keys = fresh_keys(6)
    blocks = [kv_block(10 + i) for i in range(6)]
    assert client.batch_put(keys[:4], blocks[:4]) == [True] * 4
    outs = [torch.empty_like(b) for b in blocks]
    res = client.batch_get_into(keys, outs)
    assert res == [True, True, True, True, False, False]
    for o, b in zip(outs[:4], blocks[:4], strict=True):
        assert torch.equal(o, b)
    got = client.batch_get(keys)
    assert got[4] is None and got[5] is None
    assert all(torch.equal(g, b) for g, b in zip(got[:4], blocks[:4], strict=True))
    assert client.exists(keys) == [True] * 4 + [False] * 2
    assert client.match_prefix(keys) == 4
    assert client.remove(keys[2:]) == 2
    assert client.match_prefix(keys) == 2


def test_batch_put_mixes_good_and_bad_values(client: StoreClient) -> None:
    keys = fresh_keys(3)
    res = client.batch_put(keys, [kv_block(1), "not a tensor", kv_block(2, head_dim=16)])
    assert res[0] is True
    assert isinstance(res[1], InvalidValue)
    assert isinstance(res[2], LayoutMismatch)  # head dim 16 is not this namespace's block
    assert client.exists(keys) == [True, False, False]


def test_get_into_refuses_a_buffer_of_another_dtype(client: StoreClient) -> None:
    (k,) = fresh_keys(1)
    client.put(k, kv_block(5))
    out = torch.empty(2, 2, 2, 4, 8, dtype=torch.float16)  # same bytes, other dtype
    with pytest.raises(LayoutMismatch):
        client.get_into(k, out)
    small = torch.empty(2, 2, 2, 2, 8, dtype=torch.bfloat16)
    assert client.batch_get_into([k], [small])[0].__class__ is LayoutMismatch
    # the connection is still in step afterwards
    assert torch.equal(client.get(k), kv_block(5))


def test_namespace_mismatch_is_a_miss(store_server: ServerProcess, client: StoreClient) -> None:
    (k,) = fresh_keys(1)
    client.put(k, kv_block(6))
    other = Namespace("other-model", NS.layout)
    with store_server.client(ALPHA, transport=client.config.transport, namespace=other) as c:
        assert c.exists([k]) == [True]  # present under this tenant...
        assert c.get(k) is None  # ...but never handed to another model's namespace


def test_large_blocks_and_cross_transport(store_server: ServerProcess) -> None:
    keys = fresh_keys(2)
    big = [np.random.default_rng(i).integers(0, 255, 4 << 20, dtype=np.uint8) for i in range(2)]
    with store_server.client(ALPHA, transport="shm") as shm:
        assert shm.batch_put(keys, big) == [True, True]
    with store_server.client(ALPHA, transport="tcp") as tcp:
        outs = [np.empty(4 << 20, dtype=np.uint8) for _ in range(2)]
        assert tcp.batch_get_into(keys, outs) == [True, True]
        assert all((o == b).all() for o, b in zip(outs, big, strict=True))
        assert tcp.put(keys[0], big[0]) is False


def test_ssd_blocks_are_served_on_both_paths(store_server: ServerProcess) -> None:
    keys = fresh_keys(3)
    blocks = [kv_block(40 + i) for i in range(3)]
    with store_server.client(ALPHA, transport="tcp") as c:
        c.batch_put(keys, blocks)
        with store_server.client(ADMIN) as admin:
            AdminClient(admin).evict("dram", 0)  # everything down to SSD
        assert c.stats()["tiers"]["dram"]["blocks"] == 0
        got = c.batch_get(keys)
        assert all(torch.equal(g, b) for g, b in zip(got, blocks, strict=True))
    with store_server.client(ALPHA, transport="shm") as c:
        out = torch.empty_like(blocks[0])
        assert c.get_into(keys[0], out) and torch.equal(out, blocks[0])


def test_same_host_data_goes_over_the_unix_socket(store_server: ServerProcess) -> None:
    with store_server.client(ALPHA, transport="shm") as c:
        assert c.server_info["unix_socket"]
        c.exists(fresh_keys(1))
        pool = c._pool
        assert pool is not None
        (conn, _t), *_ = pool._idle
        assert conn.fs.sock.family == socket.AF_UNIX
    with store_server.client(ALPHA, transport="tcp") as c:
        c.exists(fresh_keys(1))
        assert c._pool is not None
        assert c._pool._idle[0][0].fs.sock.family == socket.AF_INET


def test_unreachable_unix_socket_falls_back_to_tcp(store_server: ServerProcess) -> None:
    with store_server.client(ALPHA, transport="shm") as c:
        assert c._pool is not None and c._pool._server is not None
        bogus = pb.InfoResponse()
        bogus.CopyFrom(c._pool._server)
        bogus.unix_socket = "no-such-kvstore-socket"  # e.g. another network namespace
        c._pool._server = bogus
        c._pool._locate = lambda deadline: bogus
        (k,) = fresh_keys(1)
        assert c.put(k, kv_block(77)) and torch.equal(c.get(k), kv_block(77))
        # the read was served from the published index and owes a TOUCH: the pool's
        # flusher may hold the connection for a moment to send it
        pool = c._pool
        wait_until(lambda: pool._idle, "the connection back in the pool")
        assert pool._idle[0][0].fs.sock.family == socket.AF_INET
        assert c.transport == "shm"  # still copying through shared memory


def test_read_leases_go_back_with_the_next_request_or_when_idle(
    store_server: ServerProcess,
) -> None:
    keys = fresh_keys(2)
    with store_server.client(ALPHA, transport="shm") as c:
        c.batch_put(keys, [kv_block(90), kv_block(91)])
        assert c.batch_get_into(keys, [torch.empty_like(kv_block(0)) for _ in keys]) == [True] * 2
        # Idle: the pool's flusher hands the two leases back within milliseconds.
        wait_until(lambda: c.stats()["server"]["leases"] == 0, "the leases handed back", within=5)
        # Busy: the next request carries them (and takes its own).
        c.get(keys[0])
        c.exists(keys)
        assert c.stats()["server"]["leases"] == 0
