"""Write-path faults of a real ``kvstore serve`` (issue 18): batches larger than free
DRAM, concurrent writers racing for room, deadlines on the direct shared-memory path,
and a PUT that claims an absurd body. Writers racing for room run on the in-memory
network too (tests/support/memory_fixtures.py), in the hermetic run."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.errors import KVStoreError, TimeoutError_
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, FrameSocket, Op
from tests.support.memory_fixtures import factory_of, over
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA

MIB = 1 << 20


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(16 - len(tag), "big") for i in range(n)]


def _value(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, dtype=np.uint8)


@pytest.mark.process
def test_a_shm_batch_larger_than_free_dram_spills_to_ssd(server_factory: ServerFactory) -> None:
    """40 x 1 MiB into 16 MiB of DRAM over shared memory: every item is stored (the
    batch goes in rounds whose commits demote to SSD), none fails for want of DRAM."""
    server = server_factory(dram_bytes="16MiB", ssd_bytes="128MiB")
    keys = _keys(40, b"spill")
    with server.client(ALPHA, transport="shm") as c:
        res = c.batch_put(keys, [_value(i, MIB) for i in range(40)])
        assert c.transport == "shm"
        assert res == [True] * 40, [r for r in res if r is not True][:3]
        tiers = c.stats()["tiers"]
        assert tiers["ssd"]["blocks"] >= 24
        out = np.empty(MIB, dtype=np.uint8)
        for i in (0, 20, 39):
            assert c.get_into(keys[i], out) and out[0] == i and out[-1] == i


@pytest.mark.parametrize(("kind", "transport"), over("shm", "tcp"))
def test_concurrent_writers_of_large_blocks_lose_no_puts(
    request: pytest.FixtureRequest, kind: str, transport: str
) -> None:
    """4 writers of 8 MiB blocks into 32 MiB of DRAM + SSD: no put is lost to a node
    that is only momentarily full (demotions in flight, others' reservations)."""
    server = factory_of(request, kind)(dram_bytes="32MiB", ssd_bytes="256MiB")
    writers, per_writer = 4, 4
    keys = _keys(writers * per_writer, b"race" + transport.encode())
    failures: list[object] = []
    start = threading.Barrier(writers)

    def write(w: int) -> None:
        with server.client(ALPHA, transport=transport) as c:
            start.wait(timeout=20)
            for j in range(per_writer):
                i = w * per_writer + j
                try:
                    if not c.put(keys[i], _value(i, 8 * MIB)):
                        failures.append(f"{i} already stored")
                except KVStoreError as exc:
                    failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    with server.client(ALPHA, transport="tcp") as c:
        assert c.exists(keys) == [True] * len(keys)


@pytest.mark.process
def test_a_direct_shm_read_honours_its_deadline(server_factory: ServerFactory) -> None:
    server = server_factory()
    key = _keys(1, b"direct")[0]
    out = np.empty(MIB, dtype=np.uint8)
    with server.client(ALPHA, transport="shm") as c:
        assert c.put(key, _value(7, MIB))
        assert c.get_into(key, out) and c.get_into(key, out)  # the second one is direct
        direct = c.counters.get("shm_direct_reads")
        assert direct >= 1
        with pytest.raises(TimeoutError_):
            c.get_into(key, out, timeout=0)
        assert c.counters.get("shm_direct_reads") == direct  # nothing served past it
        assert c.get_into(key, out) and out[0] == 7


@pytest.mark.process
def test_a_put_claiming_2_62_bytes_is_refused_at_once(server_factory: ServerFactory) -> None:
    server = server_factory(io_timeout_s=30)
    huge = 1 << 62
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(10)
    hello = pb.Hello(token=ALPHA.token, protocol=PROTOCOL).SerializeToString()
    fs.send(Op.HELLO, hello)
    op, meta_len, _ = fs.recv_header()
    assert op == Op.INFO
    fs.recv_bytes(meta_len)
    req = pb.PutRequest()
    req.items.add(key=b"h" * 16, meta=pb.ValueMeta(dtype="uint8", shape=[huge], nbytes=huge))
    meta = req.SerializeToString()
    t0 = time.monotonic()
    sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), huge) + meta)
    op, meta_len, _ = fs.recv_header()  # no payload sent: an answer now, not at 30 s
    took = time.monotonic() - t0
    assert op == Op.ERROR
    assert "exceeds" in pb.Status.FromString(fs.recv_bytes(meta_len)).message
    assert took < 5.0, f"refused only after {took:.1f} s"
    fs.close()
    with server.client(ALPHA, transport="tcp") as c:  # and it still serves
        assert c.put(b"k" * 16, np.arange(16, dtype=np.uint8))
