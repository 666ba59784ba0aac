"""Same-host reads through the published DRAM index (kvstore/shm/index.py,
kvstore/client/transport/shm_direct.py): the index follows every move of a block, a reader
racing a writer never returns wrong bytes, and a real server counts direct reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import StoreClient
from kvstore.client.transport.shm_direct import FALLBACK, DirectReader
from kvstore.node.store import StoreNode
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import WAYS, IndexReader, IndexWriter, buckets_for
from kvstore.shm.segment import map_segment
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from tests.support.server_process import ALPHA, BRAVO, ServerProcess

KiB = 1024
pytestmark = pytest.mark.skipif(
    not __import__("kvstore.shm.index", fromlist=["x"]).reader_supported(),
    reason="direct reads need x86-64 memory ordering",
)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _value(i: int, version: int, n: int = 16 * KiB) -> np.ndarray:
    """A block whose every byte says which key and version it belongs to."""
    v = np.full(n, (i * 31 + version) % 251, dtype=np.uint8)
    v[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return v


@pytest.fixture
def node(tmp_path: Path):
    n = StoreNode(dram_bytes=1 << 20, ssd_path=str(tmp_path / "ssd"), ssd_bytes=8 << 20)
    n.publish_index()
    yield n
    n.close()


def _reader(n: StoreNode) -> tuple[DirectReader, IndexReader]:
    idx = IndexReader(n.publish_index())
    mm = map_segment(n.shm_name or "", n.stats()["tiers"]["dram"]["capacity"], create=False)
    return DirectReader(idx, np.frombuffer(mm, dtype=np.uint8), "t"), idx


def _read(d: DirectReader, key: bytes, n: int = 16 * KiB):
    out = np.empty(n, dtype=np.uint8)
    r, got = d.read(key, out, True, b"", False, NodeCounters())
    return (out if r is True else r), got


def test_writer_and_reader_agree_on_slots() -> None:
    w = IndexWriter(f"kvtest-idx-{time.monotonic_ns()}", 64 << 20)
    try:
        r = IndexReader(w.name)
        assert r.alive() and r.nbuckets == buckets_for(64 << 20)
        assert w.publish(_key(1), 4096)
        slot, seq = r.find(_key(1))
        assert r.offset(slot) == 4096 and seq % 2 == 0
        w.unpublish(_key(1))
        assert r.find(_key(1)) is None and not r.unchanged(slot, seq)
        assert not w.publish(b"short", 0)  # only 16-byte keys are published
        w.close()
        assert not r.alive()
        r.close()
    finally:
        w.close()


def test_a_full_bucket_leaves_keys_unpublished() -> None:
    w = IndexWriter(f"kvtest-idx-{time.monotonic_ns()}", 1 << 20)
    try:
        nb = w.nbuckets
        same = [(b * nb + 3).to_bytes(8, "little") + bytes(8) for b in range(WAYS + 2)]
        assert [w.publish(k, 256 * i) for i, k in enumerate(same)] == [True] * WAYS + [False] * 2
        assert w.unpublished == 2
        w.unpublish(same[0])
        assert w.publish(same[-1], 0)  # a way came free
    finally:
        w.close()


def test_a_block_the_index_has_no_room_for_is_counted(tmp_path: Path) -> None:
    n = StoreNode(dram_bytes=1 << 20)
    try:
        n.publish_index()
        nb = buckets_for(1 << 20)
        same = [(b * nb + 5).to_bytes(8, "little") + bytes(8) for b in range(WAYS + 1)]
        for i, k in enumerate(same):
            n.put(k, _value(i, 0, 4 * KiB))
        assert n.counters.get("shm_index_full") == 1
    finally:
        n.close()


def test_the_index_follows_puts_moves_and_removals(node: StoreNode) -> None:
    d, _ = _reader(node)
    for i in range(4):
        node.put(_key(i), _value(i, 0))
    got, n = _read(d, _key(0))
    assert n == 16 * KiB and np.array_equal(got, _value(0, 0))
    # Fill DRAM until key 0 is demoted to SSD: it leaves the index.
    i = 4
    while node.tier_of(_key(0)) is TierKind.DRAM:
        node.put(_key(i), _value(i, 0))
        i += 1
    assert _read(d, _key(0))[0] is FALLBACK
    # A leased read promotes it back to DRAM; the index has it again, at its new place.
    assert np.array_equal(node.get(_key(0)), _value(0, 0))
    assert node.tier_of(_key(0)) is TierKind.DRAM
    assert np.array_equal(_read(d, _key(0))[0], _value(0, 0))
    node.remove([_key(0)])
    assert _read(d, _key(0))[0] is FALLBACK
    d.close()


def test_a_read_that_races_a_reuse_falls_back(node: StoreNode) -> None:
    d, idx = _reader(node)
    node.put(_key(1), _value(1, 0))
    slot, seq = idx.find(_key(1))
    node.remove([_key(1)])
    node.put(_key(2), _value(2, 0))  # most likely the same extent
    assert not idx.unchanged(slot, seq)  # what the reader checks after its copy
    assert _read(d, _key(1))[0] is FALLBACK
    assert np.array_equal(_read(d, _key(2))[0], _value(2, 0))


def test_namespace_and_tenant_must_match(node: StoreNode) -> None:
    d, _ = _reader(node)
    node.put(_key(5), _value(5, 0))
    out = np.empty(16 * KiB, dtype=np.uint8)
    r, _ = d.read(_key(5), out, True, b"\x01" * 16, False, NodeCounters())
    assert r is FALLBACK  # stored without a namespace; the scope expects one
    # A client scopes keys to its tenant: a raw key of the node is not its key.
    assert d.scoped([_key(5)]) == Principal("t").scope_all([_key(5)]) != [_key(5)]


def test_readers_racing_writers_never_see_torn_or_foreign_bytes(node: StoreNode) -> None:
    """Writers keep replacing blocks (remove + put of a new version, extents reused);
    readers copy through the index at the same time. Every direct hit must be one
    whole version of the key asked for."""
    d, _ = _reader(node)
    keys = 24  # 24 x 16 KiB of a 1 MiB DRAM tier: plenty of reuse and demotion
    for i in range(keys):
        node.put(_key(i), _value(i, 0))
    stop = time.monotonic() + 2.0
    errors: list[str] = []
    hits = [0]

    def write() -> None:
        v = 1
        while time.monotonic() < stop:
            for i in range(keys):
                node.remove([_key(i)])
                node.put(_key(i), _value(i, v))
            v += 1

    def read() -> None:
        out = np.empty(16 * KiB, dtype=np.uint8)
        while time.monotonic() < stop:
            for i in range(keys):
                r, _ = d.read(_key(i), out, True, b"", False, NodeCounters())
                if r is not True:
                    continue
                hits[0] += 1
                if int.from_bytes(out[:8].tobytes(), "little") != i:
                    errors.append(f"key {i}: bytes of key {out[:8]}")
                elif not (out[8:] == out[8]).all():
                    errors.append(f"key {i}: a torn copy")

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:5]
    assert hits[0] > 0


# -- through a real server ----------------------------------------------------------------


def test_direct_reads_are_counted_by_the_server(store_server: ServerProcess) -> None:
    keys = [f"direct-count-{i}".encode().ljust(16, b".") for i in range(4)]
    values = [_value(i, 7, 64 * KiB) for i in range(4)]
    with store_server.client(ALPHA, transport="shm") as c:
        c.batch_put(keys, values)
        before = c.stats()
        outs = [np.empty(64 * KiB, dtype=np.uint8) for _ in keys]
        assert c.batch_get_into(keys, outs) == [True] * 4  # leased: learns the scope
        for _ in range(3):
            assert c.batch_get_into(keys, outs) == [True] * 4
        assert all(np.array_equal(o, v) for o, v in zip(outs, values, strict=True))
        assert c.counters.get("shm_direct_reads") == 12
        after = c.stats()  # settles the touches first
        hits = after["counters"]["hits_dram"] - before["counters"].get("hits_dram", 0)
        assert hits == 16
        out = after["server"]["bytes_out_shm"] - before["server"].get("bytes_out_shm", 0)
        assert out == 16 * 64 * KiB
        assert c.remove(keys[:1]) == 1
        assert c.get(keys[0]) is None  # removed: not in the index, a real miss


def test_tenants_do_not_read_each_other_through_the_index(store_server: ServerProcess) -> None:
    key = b"direct-tenant-k1"
    with (
        store_server.client(ALPHA, transport="shm") as a,
        store_server.client(BRAVO, transport="shm") as b,
    ):
        assert a.put(key, _value(1, 1))
        a.get(key)
        b.get(key)  # both learn their scope
        assert a.get(key) is not None
        assert b.get(key) is None
        assert b.counters.get("shm_direct_reads") == 0


def test_direct_reads_can_be_turned_off(store_server: ServerProcess) -> None:
    key = b"direct-off-key-1"
    with StoreClient.connect(
        store_server.address, token=ALPHA.token, transport="shm", shm_direct=False
    ) as c:
        c.put(key, _value(3, 3))
        for _ in range(3):
            assert np.array_equal(c.get(key), _value(3, 3))
        assert c.counters.get("shm_direct_reads") == 0


def test_a_restarted_server_is_read_through_its_new_index(server_factory) -> None:
    server = server_factory()
    key = b"direct-restart-1"
    with server.client(ALPHA, transport="shm") as c:
        c.put(key, _value(4, 4))
        c.get(key)
        c.get(key)
        assert c.counters.get("shm_direct_reads") == 1
        server.restart()
        # The old index is dead (its owner is gone): no direct read of the old segment.
        assert c.get(key) is None  # DRAM only: the block went with the old process
        c.put(key, _value(4, 5))
        assert np.array_equal(c.get(key), _value(4, 5))
        assert np.array_equal(c.get(key), _value(4, 5))
        assert c.counters.get("shm_direct_reads") >= 2


def test_a_lost_touch_report_does_not_fail_the_read() -> None:
    """The reads a TOUCH reports are done; a socket that breaks while reporting them
    marks the connection broken (the pool drops it) and the call still succeeds."""
    from kvstore._proto import store_pb2 as pb
    from kvstore.client.transport.conn import DataConn
    from kvstore.errors import TransportError

    class BrokenSocket:
        broken = False
        closed = False

        def set_timeout(self, seconds: float) -> None:
            pass

        def send_raw(self, data: bytes) -> None:
            self.broken = True
            raise TransportError("data socket send: connection reset")

    conn = DataConn(BrokenSocket(), pb.InfoResponse())  # type: ignore[arg-type]
    for i in range(DataConn.TOUCH_BATCH):
        conn.defer_touch([_key(i)], 4096, 0.0001)
    assert not conn.usable and not conn.owes


def test_big_batches_are_reported_in_frames_the_server_accepts(
    store_server: ServerProcess,
) -> None:
    keys = [f"direct-big-{i:05d}".encode().ljust(16, b".") for i in range(300)]
    with store_server.client(ALPHA, transport="shm") as c:
        assert c.batch_put(keys, [_value(i, 1, 4 * KiB) for i in range(300)]) == [True] * 300
        outs = [np.empty(4 * KiB, dtype=np.uint8) for _ in keys]
        before = c.stats()["counters"].get("hits_dram", 0)
        for _ in range(3):  # the first learns the scope; 600 keys then read directly
            assert c.batch_get_into(keys, outs) == [True] * 300
        assert c.counters.get("shm_direct_reads") == 600
        assert c.stats()["counters"]["hits_dram"] - before == 900


def test_an_oversized_touch_is_dropped_without_a_reply(store_server: ServerProcess) -> None:
    """TOUCH has no reply: one the server refuses must not put an ERROR frame where the
    client expects the answer to its next request."""
    from kvstore._proto import store_pb2 as pb
    from kvstore.client.transport.conn import DataConn
    from kvstore.wire.frames import Op, frame

    conn = DataConn.open(
        ("127.0.0.1", store_server.data_port), ALPHA.token, deadline=time.monotonic() + 5
    )
    try:
        too_many = pb.TouchRequest(keys=[_key(i) for i in range(5000)])
        conn.fs.send_raw(frame(Op.TOUCH, too_many.SerializeToString()))
        req = pb.KeysRequest(keys=[_key(1)])
        reply, _ = conn.call(Op.EXISTS, req, pb.ExistsResponse, time.monotonic() + 5)
        assert list(reply.present) == [False]
    finally:
        conn.close()
