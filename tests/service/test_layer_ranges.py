"""Ranged reads for layer-wise loading (issue 20): layers [a, b) of a block into a buffer
sized for them, over every transport (TCP, the leased shared-memory path, the published
index), from DRAM and from SSD. A range is verified before it is handed over: on the
socket against the server's xxh3 of exactly those bytes, so a corrupted range is a miss.
The bytes are the block's own: ``block[a:b]``, whatever the path, the in-memory
network's included (tests/support/memory_fixtures.py: the hermetic run's case)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash

from kvstore import Namespace, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore.blocks import KIND_NUMPY, BlockHeader, layer_range, layer_span
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.tcp import TcpTransport
from kvstore.errors import InvalidValue, KVStoreError, LayoutMismatch
from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import HEADER, MAGIC, REPLY, FrameSocket, Op
from tests.support.frame_pair import frame_pair
from tests.support.memory_fixtures import Served, factory_of, over, reach, serving
from tests.support.server_process import ALPHA

pytest_plugins = ["tests.support.server_fixtures"]

L, H, B, D = 6, 2, 16, 8
NS = Namespace("ranged-model", f"fp32:L{L}:H{H}:D{D}:B{B}")
KEY = bytes(range(16))


def block(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, 2, H, B, D)).astype(np.float32)


def keys(tag: int, n: int) -> list[bytes]:
    return prefix_keys([tag] * (B * n), block_tokens=B, namespace=NS)


# -- the receiving end, against a scripted peer (no process) ------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[FrameSocket, socket.socket]]:
    """A client FrameSocket and the raw socket of its scripted peer."""
    with frame_pair() as pair:
        yield pair


def _ranged_reply(whole: np.ndarray, layers: tuple[int, int], range_sum: int) -> bytes:
    payload = whole.tobytes()
    header = BlockHeader(
        "float32", whole.shape, KIND_NUMPY, KEY, b"\0" * 16, len(payload), 0
    )  # the whole block's checksum is not what a range is checked against
    lo, hi = layer_span(header, layers)
    ref = pb.BlockRef(found=True, header=header.pack(), offset=-1, range_checksum=range_sum)
    meta = pb.GetResponse(blocks=[ref]).SerializeToString()
    return HEADER.pack(MAGIC, Op.GET | REPLY, 0, len(meta), hi - lo) + meta + payload[lo:hi]


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_range_is_checked_against_the_servers_checksum_of_it(
    pair: tuple[FrameSocket, socket.socket], corrupt: bool
) -> None:
    fs, peer = pair
    whole, layers = block(1), (2, 5)
    good = xxhash.xxh3_64_intdigest(whole[2:5].tobytes())
    seen: list[pb.GetRequest] = []

    def serve() -> None:
        raw = peer.recv(1 << 16)
        seen.append(pb.GetRequest.FromString(raw[HEADER.size :]))
        peer.sendall(_ranged_reply(whole, layers, good ^ 1 if corrupt else good))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    transport = TcpTransport(NodeCounters())
    conn = DataConn(fs, pb.InfoResponse())
    out = np.zeros((3, 2, H, B, D), np.float32)
    got = transport.read(conn, [KEY], [out], pb.Scope(), time.monotonic() + 5, layers)
    t.join()
    assert (seen[0].layer_from, seen[0].layer_to) == layers
    if corrupt:
        assert got == [False]  # a miss, never the bytes
        assert transport.counters.get("corrupt_transfers") == 1
    else:
        assert got == [True] and np.array_equal(out, whole[2:5])
    assert conn.usable  # the range was consumed either way


def test_layer_ranges_are_checked_before_anything_is_sent() -> None:
    assert layer_range(None) is None
    assert layer_range((1, 3)) == (1, 3)
    for bad in [(2, 2), (3, 1), (-1, 2), (1,), "ab", (0, 1 << 33)]:
        with pytest.raises(InvalidValue):
            layer_range(bad)
    header = BlockHeader("float32", (L, 2, H, B, D), KIND_NUMPY, KEY, b"\0" * 16, 6 * 2048, 0)
    assert layer_span(header, (0, L)) == (0, 6 * 2048)
    assert layer_span(header, (1, 2)) == (2048, 4096)
    with pytest.raises(InvalidValue):
        layer_span(header, (0, L + 1))


# -- against a real server, and the same logic on the in-memory network -----------------


@pytest.mark.parametrize(
    ("kind", "transport", "direct"),
    [
        pytest.param("memory", "", False, id="memory"),
        *(
            pytest.param("process", t, d, marks=pytest.mark.process, id=f"{t}-{d}")
            for t, d in [("tcp", True), ("shm", False), ("shm", True)]
        ),
    ],
)
def test_every_range_reads_the_blocks_own_bytes(
    request: pytest.FixtureRequest, kind: str, transport: str, direct: bool
) -> None:
    server = serving(request, kind)
    ks = keys({"tcp": 10, "shm": 20, "": 30}[transport] + direct, 3)
    blocks = [block(i) for i in range(3)]
    with server.client(ALPHA, namespace=NS, transport=transport, shm_direct=direct) as c:
        assert c.batch_put(ks, blocks) == [True, True, True]
        for _ in range(2):  # the first shm read teaches the direct reader the namespace
            for a, b in [(0, 1), (1, 4), (5, 6), (0, L)]:
                outs = [np.zeros((b - a, 2, H, B, D), np.float32) for _ in ks]
                assert c.batch_get_into(ks, outs, layers=(a, b)) == [True, True, True]
                for out, whole in zip(outs, blocks, strict=True):
                    assert np.array_equal(out, whole[a:b])
        assert c.transport == (transport or kind)


def test_ranges_of_torch_bf16_blocks_and_the_async_client(any_server: Served) -> None:
    import asyncio

    from kvstore import AsyncStoreClient

    store_server = any_server
    ns = Namespace("ranged-bf16", f"bf16:L{L}:H{H}:D{D}:B{B}")
    k = prefix_keys([7] * B, block_tokens=B, namespace=ns)[0]
    t = torch.randn(L, 2, H, B, D).to(torch.bfloat16)
    with store_server.client(ALPHA, namespace=ns) as c:
        assert c.put(k, t) is True
        out = torch.empty(2, 2, H, B, D, dtype=torch.bfloat16)
        assert c.get_into(k, out, layers=(3, 5)) is True
        assert torch.equal(out, t[3:5])

    async def read() -> torch.Tensor:
        ac = await AsyncStoreClient.connect(
            store_server.address, token=ALPHA.token, namespace=ns, **reach(store_server)
        )
        try:
            o = torch.empty(1, 2, H, B, D, dtype=torch.bfloat16)
            assert await ac.get_into(k, o, layers=(0, 1)) is True
            return o
        finally:
            await ac.close()

    assert torch.equal(asyncio.run(read()), t[0:1])


@pytest.mark.parametrize(("kind", "transport"), over("tcp", "shm"))
def test_bad_ranges_and_buffers_are_per_key_errors(
    request: pytest.FixtureRequest, kind: str, transport: str
) -> None:
    k, raw, missing = keys({"tcp": 90, "shm": 91, "": 92}[transport], 3)
    with serving(request, kind).client(ALPHA, namespace=NS, transport=transport) as c:
        assert c.put(k, block(9)) is True
        assert c.put(raw, b"x" * (L * 2 * H * B * D * 4)) is True  # raw bytes: no layers
        good = np.zeros((2, 2, H, B, D), np.float32)
        r = c.batch_get_into(
            [k, k, raw, missing],
            [np.zeros((1, 2, H, B, D), np.float32), good, good.copy(), good.copy()],
            layers=(0, 2),
        )
        assert isinstance(r[0], LayoutMismatch)  # sized for one layer, not two
        assert r[1] is True and np.array_equal(good, block(9)[0:2])
        assert isinstance(r[2], LayoutMismatch), r[2]
        assert r[3] is False
        past = c.batch_get_into([k], [np.zeros((1, 2, H, B, D), np.float32)], layers=(L, L + 1))
        assert isinstance(past[0], KVStoreError) and "out of" in str(past[0])
        with pytest.raises(InvalidValue):
            c.get_into(k, good, layers=(1, 1))
        # the connection survived every refusal: a whole read still works
        whole = np.zeros((L, 2, H, B, D), np.float32)
        assert c.get_into(k, whole) is True and np.array_equal(whole, block(9))


@pytest.mark.parametrize(("kind", "transport"), over("tcp", "shm"))
def test_ranges_of_ssd_blocks(request: pytest.FixtureRequest, kind: str, transport: str) -> None:
    """A block demoted to SSD is sent inline whatever the transport: the range alone,
    with its checksum."""
    server = factory_of(request, kind)(dram_bytes="1MiB")
    n = 120  # 120 x 12 KiB into 1 MiB of DRAM: the first ones go to SSD
    tag = {"tcp": 150, "shm": 151, "": 152}[transport]
    ks, blocks = keys(tag, n), [block(100 + i) for i in range(n)]
    with server.client(ALPHA, namespace=NS, transport=transport) as c:
        assert all(r is True for r in c.batch_put(ks, blocks))
        tiers = c.stats()["tiers"]
        assert tiers["ssd"]["blocks"] > 0, tiers
        out = np.zeros((2, 2, H, B, D), np.float32)
        assert c.get_into(ks[0], out, layers=(4, 6)) is True
        assert np.array_equal(out, blocks[0][4:6])
