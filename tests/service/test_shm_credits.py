"""Write credits over shared memory (kvstore/client/transport/credits.py): a same-host
writer's next put copies into space lent ahead and commits in one round trip. Against
a real ``kvstore serve``: the round trips saved, the bytes stored, a credit that runs
out, and credits that are not the writer's to use."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import describe
from kvstore.client.transport import credits as credits_module
from kvstore.client.transport.conn import DataConn
from kvstore.wire.codec import meta_of
from kvstore.wire.frames import Op
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA, BRAVO, ServerProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process

KIB = 1 << 10


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(16 - len(tag), "big") for i in range(n)]


def _value(i: int, n: int = 64 * KIB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8)


@pytest.fixture
def reserves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the RESERVE requests this process sends."""
    seen: list[int] = []
    real = DataConn.call

    def call(self: DataConn, op: Op, *args: Any, **kwargs: Any) -> Any:
        if op == Op.RESERVE:
            seen.append(1)
        return real(self, op, *args, **kwargs)

    monkeypatch.setattr(DataConn, "call", call)
    return seen


def test_puts_after_the_first_take_one_round_trip(
    store_server: ServerProcess, reserves: list[int]
) -> None:
    """Ten single puts and two batches of 8 of one size: one RESERVE for each shape of
    round, every later put committed into a credit; every byte stored, as read by
    another path."""
    keys = _keys(26, b"cred")
    values = [_value(i) for i in range(26)]
    with store_server.client(ALPHA, transport="shm", pool_size=1) as c:
        for k, v in zip(keys[:10], values[:10], strict=True):
            assert c.put(k, v) is True
        assert len(reserves) == 1
        assert c.batch_put(keys[10:18], values[10:18]) == [True] * 8
        assert c.batch_put(keys[18:], values[18:]) == [True] * 8
        assert len(reserves) == 2  # the first batch needed 7 more credits than it had
        assert c.batch_put(keys[:8], values[:8]) == [False] * 8  # stored already
        assert c.stats()["server"]["credits_lent"] > 0
        with store_server.client(ALPHA, transport="tcp") as other:
            for k, v in zip(keys, values, strict=True):
                got = other.get(k)
                assert got is not None and np.array_equal(np.asarray(got), v)
    with store_server.client(ALPHA) as watcher:  # the writer's connection closed
        wait_until(lambda: watcher.stats()["server"]["credits_lent"] == 0, "credits returned")


def test_a_put_of_another_size_reserves(store_server: ServerProcess, reserves: list[int]) -> None:
    with store_server.client(ALPHA, transport="shm", pool_size=1) as c:
        keys = _keys(3, b"size")
        assert c.put(keys[0], _value(0)) is True
        assert c.put(keys[1], _value(1, 32 * KIB)) is True  # no credit of that size
        assert c.put(keys[2], _value(2)) is True  # the first size's credit
        assert len(reserves) == 2
        for i, k in enumerate(keys):
            assert np.array_equal(np.asarray(c.get(k)), _value(i, 32 * KIB if i == 1 else 64 * KIB))


def test_a_credit_that_ran_out_is_written_again(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A credit used after its lease ended (the client's margin forced below nothing):
    its COMMIT fails, and the put is written again, into the credit that COMMIT's
    reply lent, and stored."""
    server = server_factory(lease_ttl_s=1.0)
    with server.client(ALPHA, transport="shm", pool_size=1) as c:
        keys = _keys(2, b"late")
        assert c.put(keys[0], _value(0)) is True
        wait_until(lambda: c.stats()["server"]["credits_lent"] == 0, "the credit expired")
        expired = c.stats()["server"]["leases_expired"]
        monkeypatch.setattr(credits_module, "MARGIN_NS", -60_000_000_000)
        assert c.put(keys[1], _value(1)) is True
        assert np.array_equal(np.asarray(c.get(keys[1])), _value(1))
        assert expired >= 1


def _raw(server: ServerProcess, token: Any) -> DataConn:
    conn = DataConn.open(
        ("127.0.0.1", server.data_port), token.token, deadline=time.monotonic() + 10
    )
    conn.fs.set_timeout(10)
    return conn


def _credit(conn: DataConn, nbytes: int) -> int:
    req = pb.PutRequest(credits=[nbytes])
    resp, _ = conn.call(Op.RESERVE, req, pb.PutResponse, time.monotonic() + 10)
    assert len(resp.credits) == 1 and resp.credits[0].lease_id
    return int(resp.credits[0].lease_id)


def _bind(conn: DataConn, lease_id: int, key: bytes, value: np.ndarray) -> pb.PutResult:
    commit = pb.CommitRequest()
    item = commit.items.add(lease_id=lease_id, checksum=1, key=key)
    item.meta.CopyFrom(meta_of(describe(value)))
    resp, _ = conn.call(Op.COMMIT, commit, pb.PutResponse, time.monotonic() + 10)
    return resp.results[0]


def test_another_tenants_credit_cannot_be_used(store_server: ServerProcess) -> None:
    a, b = _raw(store_server, ALPHA), _raw(store_server, BRAVO)
    try:
        lease = _credit(a, 64 * KIB)
        r = _bind(b, lease, _keys(1, b"theft")[0], _value(0))
        assert r.error.code and "expired or unknown" in r.error.message
        with store_server.client(ALPHA) as c:
            assert c.stats()["server"]["credits_lent"] == 1  # still A's
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("wrong", ["size", "checksum"])
def test_a_commit_that_does_not_fit_its_credit_frees_it(
    store_server: ServerProcess, wrong: str
) -> None:
    """A block of another size than its credit, or bytes that are not what the
    checksum says: refused, nothing stored, the credit's space freed."""
    conn = _raw(store_server, ALPHA)
    key = _keys(1, b"misfit")[0]
    try:
        with store_server.client(ALPHA) as c:
            used = c.stats()["tiers"]["dram"]["used"]
            lease = _credit(conn, 64 * KIB)
            value = _value(0, 32 * KIB if wrong == "size" else 64 * KIB)
            r = _bind(conn, lease, key, value)
            assert r.error.code and not r.stored
            assert c.exists([key]) == [False]
            assert c.stats()["server"]["credits_lent"] == 0
            assert c.stats()["tiers"]["dram"]["used"] == used
    finally:
        conn.close()


def test_asking_for_too_many_credits_is_never_an_error(store_server: ServerProcess) -> None:
    """More credits than a batch may hold, and more bytes than a connection may
    borrow: the request's own results stand, with as many credits as allowed."""
    conn = _raw(store_server, ALPHA)
    try:
        value = _value(9)
        req = pb.PutRequest(credits=[64 * KIB] * 5000)
        req.items.add(key=_keys(1, b"many")[0], meta=meta_of(describe(value)))
        resp, _ = conn.call(Op.RESERVE, req, pb.PutResponse, time.monotonic() + 10)
        assert resp.results[0].lease_id  # the item's own reservation
        assert 0 < len(resp.credits) < 5000
    finally:
        conn.close()
