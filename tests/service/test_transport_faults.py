"""Bad frames, cut-off writes and expired leases on the data socket of a real server.

The server must close a connection that breaks the framing with a clear error, abort
any reservation it was filling (space reclaimed, no half block visible), and keep
serving everyone else. A same-host reader whose lease expired must get a miss, never
the bytes of whatever reused the extent. The lease protocol itself is also spoken here
frame by frame, as a client the SDK does not cover would speak it.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import HEADER_SIZE, BlockHeader
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.shm import Segment, ShmTransport
from kvstore.errors import KVStoreError
from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, REPLY, FrameSocket, Op
from kvstore.wire.ucx import available as ucx_available
from tests.support.server_process import ALPHA, ServerProcess
from tests.support.waiting import wait_until

MiB = 1 << 20


def _connect(server: ServerProcess, hello: bool = True) -> FrameSocket:
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=5)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(5)
    if hello:
        fs.send(Op.HELLO, pb.Hello(token=ALPHA.token, protocol=PROTOCOL).SerializeToString())
        op, meta_len, _ = fs.recv_header()
        assert op == Op.INFO
        fs.recv_bytes(meta_len)
    return fs


def _expect_error_then_close(fs: FrameSocket, match: str) -> None:
    op, meta_len, _ = fs.recv_header()
    assert op == Op.ERROR
    status = pb.Status.FromString(fs.recv_bytes(meta_len))
    assert match in status.message, status
    with pytest.raises(EOFError):
        fs.recv_header()
    fs.close()


def _dram_used(server: ServerProcess) -> int:
    with server.client(ALPHA) as c:
        return int(c.stats()["tiers"]["dram"]["used"])


def _put_meta(key: bytes, n: int) -> bytes:
    meta = pb.ValueMeta(dtype="uint8", shape=[n], kind=0, nbytes=n)
    return pb.PutRequest(items=[pb.PutItem(key=key, meta=meta, checksum=1)]).SerializeToString()


def test_garbage_bytes_close_the_connection_with_a_clear_error(store_server: ServerProcess) -> None:
    fs = _connect(store_server)
    fs.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _expect_error_then_close(fs, "bad frame magic")
    with store_server.client(ALPHA) as c:  # the server still serves other clients
        key = b"g" * 16
        assert c.put(key, np.arange(64, dtype=np.uint8))
        assert np.array_equal(c.get(key), np.arange(64, dtype=np.uint8))


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (HEADER.pack(MAGIC, 99, 0, 0, 0), "unknown op"),
        (HEADER.pack(MAGIC, Op.EXISTS, 0, 4, 0) + b"\xff\xff\xff\xff", "undecodable"),
        (HEADER.pack(MAGIC, Op.EXISTS, 0, 0, 10) + b"x" * 10, "carries no payload"),
        (HEADER.pack(MAGIC, Op.EXISTS, 0, 64 << 20, 0), "exceeds the limit"),
    ],
    ids=["unknown-op", "bad-meta", "unexpected-body", "huge-meta"],
)
def test_malformed_frames(store_server: ServerProcess, frame: bytes, match: str) -> None:
    fs = _connect(store_server)
    fs.sock.sendall(frame)
    _expect_error_then_close(fs, match)


def test_put_body_that_disagrees_with_its_items(store_server: ServerProcess) -> None:
    fs = _connect(store_server)
    meta = _put_meta(b"size-mismatch...", 100)
    fs.sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), 50) + meta + b"x" * 50)
    _expect_error_then_close(fs, "add up to")


def test_truncated_header_leaves_the_server_healthy(store_server: ServerProcess) -> None:
    fs = _connect(store_server)
    fs.sock.sendall(HEADER.pack(MAGIC, Op.EXISTS, 0, 10, 0)[:7])
    fs.close()
    with store_server.client(ALPHA) as c:
        assert c.exists([b"still-serving..."]) == [False]


@pytest.mark.parametrize("how", ["disconnect", "stall"])
def test_cut_off_put_is_aborted_and_its_space_reclaimed(server_factory, how: str) -> None:
    server = server_factory(io_timeout_s=0.5)
    key = b"half-written-key"
    baseline = _dram_used(server)
    fs = _connect(server)
    meta = _put_meta(key, 4 * MiB)
    fs.sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), 4 * MiB) + meta)
    fs.sock.sendall(os.urandom(MiB))  # a quarter of the payload
    with server.client(ALPHA) as c:
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] > baseline, "the reservation")
        if how == "disconnect":
            fs.close()
        else:  # the server gives up after io_timeout_s and hangs up
            with pytest.raises(EOFError):
                fs.recv_header()
            fs.close()
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] == baseline, "space reclaimed")
        assert c.exists([key]) == [False]
        assert c.get(key) is None
        assert c.stats()["server"]["connections"] == 1  # only this client's


def test_shm_writer_that_vanishes_before_commit(store_server: ServerProcess) -> None:
    key = b"shm-never-commit"
    baseline = _dram_used(store_server)
    fs = _connect(store_server)
    meta = pb.PutRequest(
        items=[
            pb.PutItem(key=key, meta=pb.ValueMeta(dtype="uint8", shape=[MiB], kind=0, nbytes=MiB))
        ]
    )
    fs.send(Op.RESERVE, meta.SerializeToString())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.RESERVE | REPLY
    resp = pb.PutResponse.FromString(fs.recv_bytes(meta_len))
    offset = resp.results[0].offset
    seg = Segment(resp.shm_name, offset + HEADER_SIZE + MiB)
    seg.extent(offset, MiB // 2)[:] = 7  # half the payload, then the writer dies
    seg.close()
    fs.close()
    with store_server.client(ALPHA) as c:
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] == baseline, "reservation aborted")
        assert c.exists([key]) == [False]


def test_commit_with_a_wrong_checksum_is_refused(store_server: ServerProcess) -> None:
    with store_server.client(ALPHA, transport="shm") as c:
        conn = _data_conn(store_server)
        key = b"bad-checksum-key"
        req = pb.PutRequest(
            items=[
                pb.PutItem(
                    key=key, meta=pb.ValueMeta(dtype="uint8", shape=[4096], kind=0, nbytes=4096)
                )
            ]
        )
        resp, _ = conn.call(Op.RESERVE, req, pb.PutResponse, time.monotonic() + 5)
        r = resp.results[0]
        seg = Segment(resp.shm_name, conn.info.shm_size)
        seg.extent(r.offset, 4096)[:] = 1
        commit = pb.CommitRequest(items=[pb.CommitItem(lease_id=r.lease_id, checksum=12345)])
        done, _ = conn.call(Op.COMMIT, commit, pb.PutResponse, time.monotonic() + 5)
        assert done.results[0].error.code == "corrupt_block"
        assert c.exists([key]) == [False]
        seg.close()
        conn.close()


def test_same_host_write_and_read_by_hand(store_server: ServerProcess) -> None:
    """The lease protocol spoken frame by frame, as a client in another language would:
    RESERVE, fill, COMMIT (once); LEASE, copy, RELEASE; ABORT gives the space back."""
    key, dropped = b"by-hand-shm-key.", b"by-hand-aborted."
    payload = np.arange(4096, dtype=np.uint8)
    deadline = time.monotonic() + 10
    with store_server.client(ALPHA, transport="tcp") as c:

        def leases() -> int:
            return int(c.stats()["server"]["leases"])

        wait_until(lambda: leases() == 0, "the module's earlier leases to end")
        baseline = _dram_used(store_server)
        conn = _data_conn(store_server)
        seg = Segment(conn.info.shm_name, conn.info.shm_size)
        try:
            meta = pb.ValueMeta(dtype="uint8", shape=[4096], kind=0, nbytes=4096)
            reserve = pb.PutRequest(items=[pb.PutItem(key=key, meta=meta)])
            resp, _ = conn.call(Op.RESERVE, reserve, pb.PutResponse, deadline)
            res = resp.results[0]
            assert res.lease_id and res.offset >= 0 and resp.lease_expires_ns > 0
            seg.extent(res.offset, 4096)[:] = payload
            item = pb.CommitItem(lease_id=res.lease_id, checksum=xxhash.xxh3_64_intdigest(payload))
            commit = pb.CommitRequest(items=[item])
            assert conn.call(Op.COMMIT, commit, pb.PutResponse, deadline)[0].results[0].stored
            again = conn.call(Op.COMMIT, commit, pb.PutResponse, deadline)[0].results[0]
            assert not again.stored and again.error.code == "reservation"  # lease spent
            assert c.get(key) == payload.tobytes()  # kind 0: bytes back

            opened, body_len = conn.call(
                Op.LEASE, pb.GetRequest(keys=[key]), pb.GetResponse, deadline
            )
            ref = opened.blocks[0]
            assert ref.found and ref.lease_id and body_len == 0  # nothing sent inline
            assert opened.lease_expires_ns > 0 and leases() == 1
            assert BlockHeader.unpack(ref.header).payload_len == 4096
            assert (seg.extent(ref.offset, 4096) == payload).all()
            conn.defer_release([ref.lease_id])  # goes out ahead of the next request
            conn.call(Op.EXISTS, pb.KeysRequest(keys=[key]), pb.ExistsResponse, deadline)
            # the server handles a RELEASE after answering the request it came with
            wait_until(lambda: leases() == 0, "the released lease to end")

            reserve = pb.PutRequest(items=[pb.PutItem(key=dropped, meta=meta)])
            res = conn.call(Op.RESERVE, reserve, pb.PutResponse, deadline)[0].results[0]
            assert res.lease_id and _dram_used(store_server) > baseline + 4096
            abort = pb.LeaseRequest(lease_ids=[res.lease_id, 12345])
            aborted = conn.call(Op.ABORT, abort, pb.LeaseResponse, deadline)[0]
            assert (aborted.released, aborted.expired) == (1, 1)  # 12345: no such lease
            assert c.exists([key, dropped]) == [True, False] and leases() == 0
            assert c.remove([key]) == 1
            assert _dram_used(store_server) == baseline
        finally:
            seg.close()
            conn.close()


def _data_conn(server: ServerProcess) -> DataConn:
    target = ("127.0.0.1", server.data_port)
    return DataConn.open(target, ALPHA.token, deadline=time.monotonic() + 5)


@pytest.mark.parametrize("guard", ["deadline", "checksum"])
def test_reader_whose_lease_expired_gets_a_miss(server_factory, guard: str) -> None:
    server = server_factory(lease_ttl_s=0.3)
    key, other = b"lease-expires-k1", b"lease-expires-k2"
    first = np.full(MiB, 1, dtype=np.uint8)
    with server.client(ALPHA, transport="shm") as c:
        assert c.put(key, first)
        conn = _data_conn(server)
        seg = Segment(conn.info.shm_name, conn.info.shm_size)
        resp, _ = conn.call(
            Op.LEASE, pb.GetRequest(keys=[key]), pb.GetResponse, time.monotonic() + 5
        )
        ref = resp.blocks[0]
        assert ref.lease_id and ref.offset >= 0
        # The reader stalls past its lease; the reaper unpins, and the extent is reused.
        wait_until(lambda: c.stats()["server"]["leases_expired"] >= 1, "the lease to expire")
        assert c.remove([key]) == 1
        assert c.put(other, np.full(MiB, 2, dtype=np.uint8))
        again, _ = conn.call(
            Op.LEASE, pb.GetRequest(keys=[other]), pb.GetResponse, time.monotonic() + 5
        )
        assert again.blocks[0].offset == ref.offset  # the stale reader's extent, reused
        conn.defer_release([again.blocks[0].lease_id])
        conn.flush_releases()
        # Now the stalled reader copies. Either guard alone turns it into a miss.
        transport = ShmTransport(NodeCounters(), seg, verify=(guard == "checksum"))
        expires = resp.lease_expires_ns if guard == "deadline" else time.monotonic_ns() + 10**12
        out = np.zeros(MiB, dtype=np.uint8)
        assert transport._copy_out(ref, out, True, expires, guard == "checksum") is False
        counter = "shm_lease_expired" if guard == "deadline" else "corrupt_transfers"
        assert transport.counters.get(counter) == 1
        seg.close()
        conn.close()


def test_frame_header_layout_is_stable() -> None:
    # 20 bytes, little-endian: magic, op, flags, 2 pad, meta_len u32, body_len u64
    assert HEADER.size == 20
    assert HEADER.pack(MAGIC, 10, 0, 3, 5) == MAGIC + bytes([10, 0, 0, 0]) + struct.pack(
        "<IQ", 3, 5
    )
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2  # the checksum in headers


def test_a_reader_on_another_clock_falls_back_to_checksums() -> None:
    """If the server's grant time is not between our send and receive, our monotonic
    clock is not the server's (another time namespace): the deadline proves nothing, so
    the copy is checksummed even with verify_shm off."""
    payload = np.arange(4096, dtype=np.uint8)
    header = BlockHeader("uint8", (4096,), 1, b"k" * 16, b"\0" * 16, 4096, 0).pack()

    class Seg:
        size = 8192

        def extent(self, offset: int, n: int) -> np.ndarray:
            return payload[:n]

    class Conn:
        usable = True

        def call(self, op, msg, cls, deadline, body=(), body_len=0):
            ref = pb.BlockRef(found=True, header=header, lease_id=7, offset=0)
            far = time.monotonic_ns() + 10**12
            return pb.GetResponse(blocks=[ref], lease_expires_ns=far, server_now_ns=1), 0

        def defer_release(self, lease_ids) -> None:
            pass

    transport = ShmTransport(NodeCounters(), Seg(), verify=False)
    out = np.zeros(4096, dtype=np.uint8)
    got = transport.read(Conn(), [b"k" * 16], [out], pb.Scope(), time.monotonic() + 5)
    assert got == [False]  # header checksum 0 != xxh3(payload): refused
    assert transport.counters.get("shm_clock_mismatch") == 1
    assert transport.counters.get("corrupt_transfers") == 1


@pytest.mark.parametrize("transport", ["tcp", "shm", *(("ucx",) if ucx_available() else ())])
def test_a_server_that_stalls_and_resumes_never_mixes_up_answers(
    server_factory: Any, transport: str
) -> None:
    """The server is stopped (SIGSTOP) and resumed again and again while two clients
    work: calls that outlive their deadline fail, and no call ever returns the answer
    to another request (a reply left behind by a timed-out call would be read as the
    next call's). Bounded: 3 s of load."""
    server: ServerProcess = server_factory(transport="ucx" if transport == "ucx" else None)
    proc = server.proc
    assert proc is not None
    keys = [f"stall-{i:03d}".encode().ljust(16, b".") for i in range(120)]
    stored = 80  # keys[:80] are stored
    with server.client(ALPHA) as c:
        c.batch_put(keys[:stored], [np.full(8192, i % 251, np.uint8) for i in range(stored)])
    stop = threading.Event()
    wrong: list[tuple[Any, ...]] = []
    done = {"match": 0, "get": 0, "failed": 0}

    def matcher() -> None:
        rng = random.Random(1)
        with server.client(ALPHA, transport=transport, timeout_s=0.3, retries=1) as c:
            while not stop.is_set():
                a, n = rng.randrange(0, 100), rng.randint(1, 40)
                try:
                    got = c.match_prefix(keys[a : a + n])
                except KVStoreError:
                    done["failed"] += 1
                    continue
                if got != max(0, min(n, stored - a)):
                    wrong.append(("match_prefix", a, n, got))
                done["match"] += 1

    def getter() -> None:
        rng = random.Random(2)
        outs = [np.empty(8192, np.uint8) for _ in range(4)]
        with server.client(ALPHA, transport=transport, timeout_s=0.3, retries=1) as c:
            while not stop.is_set():
                a = rng.randrange(0, stored - 4)
                try:
                    res = c.batch_get_into(keys[a : a + 4], outs)
                except KVStoreError:
                    done["failed"] += 1
                    continue
                for j, (ok, out) in enumerate(zip(res, outs, strict=True)):
                    if ok is not True or not (out == (a + j) % 251).all():
                        wrong.append(("get", a + j, ok, int(out[0])))
                done["get"] += 1

    workers = [threading.Thread(target=f, daemon=True) for f in (matcher, getter)]
    for t in workers:
        t.start()
    rng = random.Random(3)
    end = time.monotonic() + 3.0
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.05, 0.2))
            proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.05, 0.6))  # half the stalls outlive a call's deadline
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.send_signal(signal.SIGCONT)
        stop.set()
        for t in workers:
            t.join(10)
    assert wrong == []
    assert done["match"] > 0 and done["get"] > 0
