"""The TCP transport's device paths against a peer that speaks the data-socket frames by
hand (tests/support/frame_pair.py): one body for CPU tensors moved by the host copy
engine (tests/service/test_device_tcp.py) and for CUDA tensors
(tests/gpu/test_client_cuda.py), so the CPU run covers the same transport code.

- A read whose payload is corrupted on the way: the peer sends a block's header with
  its true xxh3 and the payload with one byte flipped. That block is a miss, its
  tensor keeps what it held (no byte of the bad payload reaches it), and the other
  blocks of the batch are hits with exact bytes.
- A put from device tensors: the peer receives the PUT frame (each payload followed by
  its xxh3), checks every trailing sum against the bytes it got and keeps the bytes,
  so the check compares them with the tensors exactly.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import BlockHeader, describe
from kvstore.client.device.side import DeviceSide
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.tcp import TcpTransport
from kvstore.copies.engine import CopyEngine
from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import HEADER, MAGIC, REPLY, Op
from kvstore.wire.trailers import SUM_TRAILER
from tests.support.frame_pair import frame_pair

__all__ = [
    "SHAPE",
    "Peer",
    "blocks",
    "check_corrupt_payloads_are_misses",
    "check_put_bytes_at_the_peer",
    "deadline",
    "device_tcp",
    "keys_for",
    "raw",
]

SHAPE = (4, 2, 8, 16, 64)  # 256 KiB of bf16 a block
SENTINEL = 7.0  # what an output holds before a read: a miss must leave it so
_NS = b"\0" * 16


def blocks(n: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.bfloat16).to(device) for _ in range(n)]


def keys_for(n: int) -> list[bytes]:
    return [f"device-wire-{i:04d}".encode() for i in range(n)]


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


class Peer:
    """The server's end of the socket, answering one request at a time in a thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received: list[tuple[pb.PutRequest, list[bytes], list[int]]] = []
        self.errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def _frame(self) -> tuple[int, bytes, int]:
        magic, op, _, meta_len, body_len = HEADER.unpack(self._recv(HEADER.size))
        assert magic == MAGIC
        return op, self._recv(meta_len), body_len

    def _run(self, fn: Any) -> None:
        def body() -> None:
            try:
                fn()
            except BaseException as exc:  # surfaced by join()
                self.errors.append(exc)

        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(10)
        assert not self._thread.is_alive()

    def answer_get(self, headers: Sequence[BlockHeader], payloads: Sequence[bytes]) -> None:
        """Answer the next GET with these blocks, payloads back to back (as sent,
        whatever their headers' sums say)."""

        def serve() -> None:
            op, _, body_len = self._frame()
            assert op == Op.GET
            self._recv(body_len)
            refs = [pb.BlockRef(found=True, header=h.pack(), offset=-1) for h in headers]
            meta = pb.GetResponse(blocks=refs).SerializeToString()
            body = b"".join(payloads)
            head = HEADER.pack(MAGIC, Op.GET | REPLY, 0, len(meta), len(body))
            self.sock.sendall(head + meta + body)

        self._run(serve)

    def answer_put(self) -> None:
        """Take the next PUT (sums following the payloads), keep its bytes and sums,
        and store every item whose sum matches its bytes."""

        def serve() -> None:
            op, meta, body_len = self._frame()
            assert op == Op.PUT
            req = pb.PutRequest.FromString(meta)
            assert req.sums_follow
            datas, sums = [], []
            for item in req.items:
                datas.append(self._recv(item.meta.nbytes))
                sums.append(SUM_TRAILER.unpack(self._recv(SUM_TRAILER.size))[0])
            assert body_len == sum(len(d) + SUM_TRAILER.size for d in datas)
            self.received.append((req, datas, sums))
            results = [
                pb.PutResult(stored=xxhash.xxh3_64_intdigest(d) == s)
                for d, s in zip(datas, sums, strict=True)
            ]
            meta_out = pb.PutResponse(results=results).SerializeToString()
            self.sock.sendall(HEADER.pack(MAGIC, Op.PUT | REPLY, 0, len(meta_out), 0) + meta_out)

        self._run(serve)


@contextmanager
def device_tcp(
    engine: CopyEngine | None, conn_type: type[DataConn] = DataConn
) -> Iterator[tuple[TcpTransport, DataConn, Peer]]:
    """A TCP transport whose device side is ``engine`` (None: the process's CUDA engine),
    a connection of ``conn_type`` to a hand-driven peer, and the peer."""
    with frame_pair() as (fs, sock):
        info = pb.InfoResponse(put_sums_follow=True)
        info.limits.max_value_bytes = 1 << 30
        conn = conn_type(fs, info)
        yield TcpTransport(NodeCounters(), DeviceSide(engine)), conn, Peer(sock)


def deadline() -> float:
    return time.monotonic() + 10


def check_corrupt_payloads_are_misses(engine: CopyEngine | None, device: str) -> None:
    """A batch of five whose third payload is corrupted on the way, then a single read
    whose only payload is: each corrupt block is a miss whose tensor was never written,
    every other block a hit with exact bytes, and the stream stays in step."""
    values = blocks(5, "cpu", seed=21)
    keys = keys_for(5)
    info = describe(values[0])
    true_sums = [xxhash.xxh3_64_intdigest(raw(v)) for v in values]
    headers = [
        BlockHeader(info.dtype, info.shape, info.kind, k, _NS, info.nbytes, s)
        for k, s in zip(keys, true_sums, strict=True)
    ]
    payloads = [raw(v) for v in values]
    bad = bytearray(payloads[2])
    bad[len(bad) // 2] ^= 0x40  # one bit flipped on the way
    payloads[2] = bytes(bad)
    with device_tcp(engine) as (transport, conn, peer):
        outs = [torch.full(SHAPE, SENTINEL, dtype=torch.bfloat16, device=device) for _ in keys]
        peer.answer_get(headers, payloads)
        got = transport.read(conn, keys, outs, pb.Scope(), deadline())
        peer.join()
        assert not peer.errors, peer.errors
        assert got == [True, True, False, True, True]
        assert transport.counters.get("corrupt_transfers") == 1
        for i, (v, out) in enumerate(zip(values, outs, strict=True)):
            want = torch.full(SHAPE, SENTINEL, dtype=torch.bfloat16) if i == 2 else v
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), i
        assert conn.usable  # the corrupt payload was consumed: the stream is in step

        # a single read whose payload is corrupt, on the same connection
        one = [torch.full(SHAPE, SENTINEL, dtype=torch.bfloat16, device=device)]
        peer.answer_get(headers[2:3], payloads[2:3])
        assert transport.read(conn, keys[2:3], one, pb.Scope(), deadline()) == [False]
        peer.join()
        assert not peer.errors, peer.errors
        assert torch.equal(one[0].cpu(), torch.full(SHAPE, SENTINEL, dtype=torch.bfloat16))
        assert transport.counters.get("corrupt_transfers") == 2

        # and the same block sent intact is a hit
        peer.answer_get(headers[2:3], [raw(values[2])])
        assert transport.read(conn, keys[2:3], one, pb.Scope(), deadline()) == [True]
        peer.join()
        assert torch.equal(one[0].cpu().view(torch.int16), values[2].view(torch.int16))


def check_put_bytes_at_the_peer(
    transport: TcpTransport,
    conn: DataConn,
    peer: Peer,
    values: Sequence[torch.Tensor],
    expect: Sequence[bytes] | None = None,
) -> None:
    """Put ``values`` (device tensors) in one batch: every item stored, and the peer got
    each tensor's exact bytes (or ``expect``), each followed by their xxh3."""
    keys = keys_for(len(values))
    want = list(expect) if expect is not None else [raw(v) for v in values]
    peer.answer_put()
    got = transport.write(conn, keys, values, pb.Scope(), deadline())
    peer.join()
    assert not peer.errors, peer.errors
    assert got == [True] * len(values)
    req, datas, sums = peer.received[-1]
    assert [it.key for it in req.items] == keys
    for w, d, s in zip(want, datas, sums, strict=True):
        assert d == w
        assert s == xxhash.xxh3_64_intdigest(d)
    assert conn.usable
