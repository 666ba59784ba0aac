"""TCP batch puts that send each payload's xxh3 after it (PutRequest.sums_follow, issue
19): the client hashes payload i while the server receives it. The server must check
each item against the checksum that follows it: a wrong one fails that item alone and
stores nothing of it, the stream stays in step, and a body of the wrong length is
refused."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore.errors import CorruptBlock, error_for_code
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, REPLY, FrameSocket, Op
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA

pytestmark = pytest.mark.process

KIB = 1 << 10


def _connect(port: int) -> FrameSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(10)
    fs.send(Op.HELLO, pb.Hello(token=ALPHA.token, protocol=PROTOCOL).SerializeToString())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.INFO
    assert pb.InfoResponse.FromString(fs.recv_bytes(meta_len)).put_sums_follow
    return fs


def _put_frame(keys: list[bytes], values: list[np.ndarray], sums: list[int]) -> bytes:
    req = pb.PutRequest(sums_follow=True)
    body = b""
    for k, v, s in zip(keys, values, sums, strict=True):
        req.items.add(key=k, meta=pb.ValueMeta(dtype="uint8", shape=[v.size], nbytes=v.nbytes))
        body += v.tobytes() + struct.pack("<Q", s)
    meta = req.SerializeToString()
    return HEADER.pack(MAGIC, Op.PUT, 0, len(meta), len(body)) + meta + body


def test_a_wrong_trailing_checksum_fails_that_item_alone(server_factory: ServerFactory) -> None:
    server = server_factory()
    keys = [f"sums-follow-{i:04d}".encode() for i in range(3)]
    values = [np.full(64 * KIB, i + 1, dtype=np.uint8) for i in range(3)]
    sums = [xxhash.xxh3_64_intdigest(v) for v in values]
    sums[1] ^= 1  # the middle item's checksum is wrong
    fs = _connect(server.data_port)
    fs.sock.sendall(_put_frame(keys, values, sums))
    op, meta_len, _ = fs.recv_header()
    assert op == Op.PUT | REPLY
    resp = pb.PutResponse.FromString(fs.recv_bytes(meta_len))
    assert [r.stored for r in resp.results] == [True, False, True]
    err = resp.results[1].error
    assert isinstance(error_for_code(err.code, err.message), CorruptBlock), err
    # the stream is in step: the next request on this connection is answered
    fs.send(Op.EXISTS, pb.KeysRequest(keys=keys).SerializeToString())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.EXISTS | REPLY
    assert list(pb.ExistsResponse.FromString(fs.recv_bytes(meta_len)).present) == [
        True,
        False,
        True,
    ]
    fs.close()


def test_a_body_without_the_checksums_is_refused(server_factory: ServerFactory) -> None:
    server = server_factory()
    value = np.arange(4 * KIB, dtype=np.uint32).view(np.uint8)
    req = pb.PutRequest(sums_follow=True)
    req.items.add(
        key=b"s" * 16, meta=pb.ValueMeta(dtype="uint8", shape=[value.size], nbytes=value.nbytes)
    )
    meta = req.SerializeToString()
    fs = _connect(server.data_port)
    # the payload's length alone: the 8-byte checksum is missing from body_len
    fs.sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), value.nbytes) + meta + value.tobytes())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.ERROR
    assert "add up to" in pb.Status.FromString(fs.recv_bytes(meta_len)).message
    fs.close()
    with server.client(ALPHA, transport="tcp") as c:
        assert c.exists([b"s" * 16]) == [False]


def test_the_client_batch_path_stores_every_item_byte_exact(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    keys = [f"sums-client-{i:04d}".encode() for i in range(8)]
    values = [
        np.random.default_rng(i).integers(0, 255, 256 * KIB, dtype=np.uint8) for i in range(8)
    ]
    with server.client(ALPHA, transport="tcp") as c:
        assert c.batch_put(keys, values) == [True] * 8
        assert c.batch_put([*keys[:2], b"fresh-key-000000"], values[:3]) == [False, False, True]
        for k, v in zip(keys, values, strict=True):
            got = c.get(k)
            assert got is not None and np.array_equal(np.asarray(got), v)


def test_single_puts_sent_in_hashed_pieces_store_every_byte(
    server_factory: ServerFactory,
) -> None:
    """A single TCP put goes as pieces of ``_PIECE`` bytes, each hashed after it is
    sent, with the checksum after the payload: values that end mid-piece, span several
    pieces or fit in less than one are stored byte-exact, and a rewrite of a key stored
    already is a no-op."""
    from kvstore.client.transport.tcp import _PIECE

    server = server_factory()
    rng = np.random.default_rng(7)
    values = [
        rng.integers(0, 255, 2 * _PIECE + 12_345, dtype=np.uint8),
        rng.standard_normal((3, _PIECE // 4)).astype(np.float16),  # 1.5 pieces
        rng.integers(0, 255, 100, dtype=np.uint8),
        rng.integers(0, 255, _PIECE, dtype=np.uint8),  # exactly one piece
    ]
    keys = [f"sums-single-{i:04d}".encode() for i in range(len(values))]
    with server.client(ALPHA, transport="tcp") as c:
        for k, v in zip(keys, values, strict=True):
            assert c.put(k, v) is True
        assert c.put(keys[0], values[0]) is False  # stored already
        for k, v in zip(keys, values, strict=True):
            got = c.get(k)
            assert got is not None
            got = np.asarray(got)
            assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)
