"""The TCP read path's receiving end: polled payload receives hashed on the way in, and
fresh values built on recycled memory.

A receive that polls must still fill its buffer exactly when the sender pauses, stops
or hangs up, and the xxh3 it computes while waiting must be the payload's. A value
built on pooled memory must keep that memory for as long as anything can reach it.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import KIND_BYTES, KIND_NUMPY, KIND_TORCH, BlockHeader, checksum_stream
from kvstore.client.transport.buffers import LandingPool, fresh_landing
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.tcp import TcpTransport
from kvstore.errors import TimeoutError_, TransportError
from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import HEADER, MAGIC, REPLY, FrameSocket, Op
from tests.support.frame_pair import frame_pair

MiB = 1 << 20
KEY = bytes(range(16))


@pytest.fixture
def pair() -> Iterator[tuple[FrameSocket, socket.socket]]:
    """A client FrameSocket over loopback TCP and the raw socket of its peer."""
    with frame_pair() as pair:
        yield pair


def _send_in_pieces(
    peer: socket.socket, data: bytes, pieces: int, pause: float
) -> threading.Thread:
    def run() -> None:
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            peer.sendall(data[i : i + step])
            time.sleep(pause)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("pause", [0.0, 0.02])  # 20 ms: past the polling budget, it sleeps
def test_polled_receive_fills_exactly_and_hashes_what_arrived(
    pair: tuple[FrameSocket, socket.socket], pause: float
) -> None:
    fs, peer = pair
    payload = np.random.default_rng(1).integers(0, 255, 3 * MiB + 123, np.uint8).tobytes()
    # a frame ahead of the payload: part of the payload arrives buffered with it
    peer.sendall(HEADER.pack(MAGIC, Op.GET | REPLY, 0, 0, len(payload)) + payload[:1000])
    assert fs.recv_header() == (Op.GET | REPLY, 0, len(payload))
    sender = _send_in_pieces(peer, payload[1000:], 7, pause)
    out = bytearray(len(payload))
    digest = checksum_stream()
    fs.recv_into(memoryview(out), spin=True, digest=digest)
    sender.join()
    assert bytes(out) == payload
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(payload)
    assert not fs.broken


def test_polled_receive_of_a_payload_cut_short(pair: tuple[FrameSocket, socket.socket]) -> None:
    fs, peer = pair
    peer.sendall(b"x" * 1000)
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(TransportError, match="closed after 1000 of 4096"):
        fs.recv_into(memoryview(bytearray(4096)), spin=True, digest=checksum_stream())
    assert fs.broken


def test_polled_receive_of_a_stalled_sender_times_out(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, peer = pair
    fs.set_timeout(0.25)
    peer.sendall(b"x" * 1000)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError_):
        fs.recv_into(memoryview(bytearray(4096)), spin=True)
    assert time.monotonic() - t0 < 3
    assert fs.broken


def _get_reply(payload: bytes, header_sum: int) -> bytes:
    n = len(payload)
    header = BlockHeader("uint8", (n,), KIND_NUMPY, KEY, b"\0" * 16, n, header_sum)
    meta = pb.GetResponse(blocks=[pb.BlockRef(found=True, header=header.pack(), offset=-1)])
    body = meta.SerializeToString()
    return HEADER.pack(MAGIC, Op.GET | REPLY, 0, len(body), n) + body + payload


@pytest.mark.parametrize("corrupt", [False, True])
def test_tcp_read_checks_the_hash_taken_while_receiving(
    pair: tuple[FrameSocket, socket.socket], corrupt: bool
) -> None:
    fs, peer = pair
    payload = np.random.default_rng(2).integers(0, 255, 2 * MiB, np.uint8).tobytes()
    good = xxhash.xxh3_64_intdigest(payload)

    def serve() -> None:
        peer.recv(1 << 16)  # the GET
        peer.sendall(_get_reply(payload, good ^ 1 if corrupt else good))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    transport = TcpTransport(NodeCounters())
    conn = DataConn(fs, pb.InfoResponse())
    got = transport.read(conn, [KEY], None, pb.Scope(), time.monotonic() + 5)
    t.join()
    if corrupt:
        assert got == [None]  # a miss, never the bytes
        assert transport.counters.get("corrupt_transfers") == 1
    else:
        assert got[0].tobytes() == payload
        assert transport.counters.get("corrupt_transfers") == 0
    assert conn.usable  # the whole payload was consumed either way


def _header(kind: int, dtype: str, shape: tuple[int, ...], n: int) -> BlockHeader:
    return BlockHeader(dtype, shape, kind, KEY, b"\0" * 16, n, 0)


def _address(buf: object) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)  # type: ignore[call-overload]


def test_pool_reuses_memory_only_once_nothing_reaches_it() -> None:
    pool = LandingPool(min_bytes=1, idle_bytes=8 * MiB)
    first = pool.buffer(MiB)
    where = _address(first)
    arr = np.frombuffer(first, np.uint8).view(np.float16).reshape(512, 1024)
    del first
    part = arr[3:5]  # a view outlives the value
    mv = memoryview(part)  # type: ignore[arg-type]
    t = torch.from_numpy(arr[7])
    del arr, part
    gc.collect()
    assert pool.idle == 0
    second = pool.buffer(MiB)
    assert _address(second) != where  # still reachable: not handed out again
    del mv
    gc.collect()
    assert pool.idle == 0  # the tensor still holds it
    del t
    gc.collect()
    assert pool.idle == MiB
    third = pool.buffer(MiB - 100)  # same page-rounded size: the same region, no fault
    assert _address(third) == where
    assert pool.idle == 0
    del second, third


def test_pool_keeps_at_most_its_idle_bytes_newest_size_first() -> None:
    pool = LandingPool(min_bytes=1, idle_bytes=3 * MiB)
    small = [pool.buffer(MiB) for _ in range(3)]
    del small
    gc.collect()
    assert pool.idle == 3 * MiB
    big = pool.buffer(2 * MiB)
    del big  # older sizes make room for the size in use
    gc.collect()
    assert pool.idle == 3 * MiB
    assert pool.buffer(2 * MiB) is not None and pool.idle <= MiB


@pytest.mark.parametrize(
    ("kind", "dtype", "shape"),
    [
        (KIND_NUMPY, "float16", (256, 1024)),
        (KIND_TORCH, "bfloat16", (512, 512)),
        (KIND_BYTES, "uint8", (512 * 1024,)),
    ],
)
def test_fresh_values_of_every_kind_on_pooled_memory(
    kind: int, dtype: str, shape: tuple[int, ...]
) -> None:
    n = 512 * 1024
    data = np.random.default_rng(3).integers(0, 255, n, np.uint8)
    landing = fresh_landing(_header(kind, dtype, shape, n))
    landing.view[:] = data
    value = landing.finish()
    del landing
    gc.collect()
    if kind == KIND_TORCH:
        assert value.dtype == torch.bfloat16 and tuple(value.shape) == shape
        assert value.view(torch.uint8).numpy().tobytes() == data.tobytes()
    elif kind == KIND_NUMPY:
        assert value.dtype == np.float16 and value.shape == shape and value.flags.writeable
        assert value.tobytes() == data.tobytes()
    else:
        assert type(value) is bytes and value == data.tobytes()
    # a second value of the same size is not the first one's memory while it lives
    other = fresh_landing(_header(kind, dtype, shape, n))
    other.view[:] = 0
    if kind == KIND_TORCH:
        assert value.view(torch.uint8).numpy().tobytes() == data.tobytes()
    elif kind == KIND_NUMPY:
        assert value.tobytes() == data.tobytes()
    else:
        assert value == data.tobytes()
