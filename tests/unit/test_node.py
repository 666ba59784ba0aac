"""StoreNode against real tiers: shared-memory DRAM and an lmdb SSD tier in tmp_path."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import BlockTooLarge, CapacityError, InvalidKey, LayoutMismatch
from kvstore.events import BlockMoved, BlockRemoved, BlockStored
from kvstore.keys import Namespace, prefix_keys
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from tests.support.faults import flip_stored_bytes

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)  # 8 KiB of fp32 per block
BLOCK = 2 * 2 * 2 * 16 * 16 * 4


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return list(prefix_keys([seed] * 7 + list(range(n * 16)), 16, NS))[:n]


def _block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g)


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    n = StoreNode(
        node_id="n1",
        dram_bytes=20 * (BLOCK + 256),
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=40 * (BLOCK + 4096),
    )
    yield n
    n.close()


def test_put_get_roundtrip_kinds(node: StoreNode) -> None:
    k = _keys(3)
    t = _block(1)
    assert node.put(k[0], t, namespace=NS)
    assert not node.put(k[0], t, namespace=NS)  # same key again: kept, not duplicated
    got = node.get(k[0], namespace=NS)
    assert isinstance(got, torch.Tensor) and torch.equal(got, t)
    a = np.arange(10, dtype=np.int64)
    node.put(k[1], a)
    np.testing.assert_array_equal(node.get(k[1]), a)
    node.put(k[2], b"raw bytes")
    assert node.get(k[2]) == b"raw bytes"
    out = torch.empty(SHAPE)
    assert node.get_into(k[0], out, namespace=NS) and torch.equal(out, t)
    assert node.get(_keys(1, seed=9)[0]) is None


def test_exists_match_prefix_remove(node: StoreNode) -> None:
    k = _keys(6)
    for i in (0, 1, 2, 4):
        node.put(k[i], _block(i), namespace=NS)
    assert node.exists(k) == [True, True, True, False, True, False]
    assert node.match_prefix(k) == 3
    assert node.remove([k[1], k[5]]) == 1
    assert node.match_prefix(k) == 1
    assert node.get(k[1]) is None


def test_bad_input_refused_and_nothing_lost(node: StoreNode) -> None:
    k = _keys(2)
    node.put(k[0], _block(0), namespace=NS)
    with pytest.raises(LayoutMismatch):
        node.put(k[1], _block(0).half(), namespace=NS)
    with pytest.raises(LayoutMismatch):
        node.put(k[1], torch.zeros(2, 2, 2, 8, 16), namespace=NS)
    with pytest.raises(InvalidKey):
        node.put(b"short", _block(0))
    with pytest.raises(BlockTooLarge):
        node.put(k[1], np.zeros(10 << 20, np.uint8))
    with pytest.raises(LayoutMismatch):
        node.get_into(k[0], torch.empty(SHAPE, dtype=torch.float16), namespace=NS)
    assert node.stats()["blocks"] == 1
    assert torch.equal(node.get(k[0]), _block(0))


def test_namespace_mismatch_is_a_miss(node: StoreNode) -> None:
    k = _keys(1)
    node.put(k[0], _block(0), namespace=NS)
    other = Namespace("other-model", "fp32:L2:H2:D16:B16", "t")
    assert node.get(k[0], namespace=other) is None
    assert node.counters.get("namespace_mismatch") == 1
    assert node.get(k[0], namespace=NS) is not None


def test_demotion_promotion_and_events(node: StoreNode) -> None:
    keys = _keys(50)
    for i, k in enumerate(keys):
        node.put(k, _block(i), namespace=NS)
    st = node.stats()
    assert st["tiers"]["dram"]["blocks"] <= 20
    assert st["tiers"]["ssd"]["blocks"] >= 1
    assert st["blocks"] == 50  # nothing lost while capacity remains
    assert node.tier_of(keys[0]) is TierKind.SSD
    for i, k in enumerate(keys):  # every block still reads back exactly
        assert torch.equal(node.get(k, namespace=NS), _block(i)), i
    assert node.tier_of(keys[-1]) is TierKind.DRAM  # promoted on its hit
    ev = node.take_events()
    assert sum(isinstance(e, BlockStored) for e in ev) == 50
    assert any(isinstance(e, BlockMoved) and e.dst is TierKind.SSD for e in ev)
    assert any(isinstance(e, BlockMoved) and e.dst is TierKind.DRAM for e in ev)
    assert node.counters.get("promotions") > 0


def test_full_dram_and_ssd_evict_oldest(node: StoreNode) -> None:
    keys = _keys(100)
    for i, k in enumerate(keys):
        node.put(k, _block(i), namespace=NS)  # never raises to the writer
    st = node.stats()
    assert st["blocks"] < 100
    assert node.exists(keys[:5]) == [False] * 5  # oldest went first
    assert all(node.exists(keys[-15:]))
    assert any(isinstance(e, BlockRemoved) for e in node.take_events())


def test_pinned_block_survives_eviction(node: StoreNode) -> None:
    keys = _keys(80)
    node.put(keys[0], _block(0), namespace=NS)
    with node.pin(keys[0]) as blk:
        assert blk is not None and blk.tier is TierKind.DRAM
        before = bytes(blk.payload)
        for i, k in enumerate(keys[1:], 1):
            node.put(k, _block(i), namespace=NS)
        assert node.tier_of(keys[0]) is TierKind.DRAM
        assert bytes(blk.payload) == before  # the bytes under the reader never changed
    assert torch.equal(node.get(keys[0]), _block(0))


def test_all_pinned_is_capacity_error(tmp_path: Path) -> None:
    with StoreNode(node_id="n2", dram_bytes=3 * (BLOCK + 256)) as n:
        keys = _keys(4)
        for i in range(3):
            n.put(keys[i], _block(i))
        with n.pin(keys[0]), n.pin(keys[1]), n.pin(keys[2]), pytest.raises(CapacityError):
            n.put(keys[3], _block(3))
        n.put(keys[3], _block(3))  # after the pins go, eviction works again
        assert n.exists(keys) == [False, True, True, True]


def test_two_phase_write_invisible_until_commit(node: StoreNode) -> None:
    from kvstore.blocks import describe

    k = _keys(2)
    t = _block(5)
    res = node.reserve(k[0], describe(t), namespace=NS)
    assert node.exists([k[0]]) == [False]
    res.payload[:] = np.frombuffer(t.numpy().tobytes(), np.uint8)
    assert node.commit(res)
    assert torch.equal(node.get(k[0]), t)
    used = node.stats()["tiers"]["dram"]["used"]
    res2 = node.reserve(k[1], describe(t), namespace=NS)
    node.abort(res2)
    node.abort(res2)
    assert node.exists([k[1]]) == [False]
    assert node.stats()["tiers"]["dram"]["used"] == used


def test_commit_with_wrong_checksum_is_refused(node: StoreNode) -> None:
    from kvstore.blocks import describe
    from kvstore.errors import CorruptBlock

    k = _keys(1)
    t = _block(5)
    res = node.reserve(k[0], describe(t))
    res.payload[:] = np.frombuffer(t.numpy().tobytes(), np.uint8)
    with pytest.raises(CorruptBlock):
        node.commit(res, expected_checksum=12345)
    assert node.exists(k) == [False]


def test_a_landed_checksum_stands_for_the_commit_hash_and_is_still_checked(
    node: StoreNode,
) -> None:
    """A receiver that hashed the bytes as they landed hands that xxh3 to the commit
    (``landed_checksum``): it is checked against the writer's like a computed one, a
    mismatch stores nothing, and the block is stored under it and read back whole."""
    from kvstore.blocks import checksum, describe
    from kvstore.errors import CorruptBlock

    k = _keys(2)
    t = _block(6)
    raw = np.frombuffer(t.numpy().tobytes(), np.uint8)
    res = node.reserve(k[0], describe(t))
    res.payload[:] = raw
    with pytest.raises(CorruptBlock):  # what landed is not what the writer sent
        node.commit(res, expected_checksum=checksum(raw), landed_checksum=checksum(raw) ^ 1)
    assert node.exists([k[0]]) == [False]
    res = node.reserve(k[1], describe(t))
    res.payload[:] = raw
    assert node.commit(res, expected_checksum=checksum(raw), landed_checksum=checksum(raw))
    out = torch.zeros(SHAPE)
    assert node.get_into(k[1], out) is True and torch.equal(out, t)
    read = node.open_read(k[1])
    assert read is not None
    try:
        assert read.header.checksum == checksum(raw)
    finally:
        node.close_read(read)


def test_corrupt_ssd_block_is_a_miss(node: StoreNode, tmp_path: Path) -> None:
    keys = _keys(30)
    for i, k in enumerate(keys):
        node.put(k, _block(i), namespace=NS)
    assert node.tier_of(keys[0]) is TierKind.SSD
    flip_stored_bytes(tmp_path / "ssd", _block(0).numpy().tobytes())
    out = torch.zeros(SHAPE)
    assert node.get_into(keys[0], out, namespace=NS) is False
    assert torch.count_nonzero(out) == 0  # the bad bytes never reached the caller
    assert node.counters.get("corrupt_blocks") == 1
    assert node.exists([keys[0]]) == [False]


def test_restart_reannounces_ssd_blocks(tmp_path: Path) -> None:
    cfg = dict(
        node_id="n3",
        dram_bytes=5 * (BLOCK + 256),
        ssd_path=str(tmp_path / "s"),
        ssd_bytes=50 * (BLOCK + 4096),
    )
    keys = _keys(20)
    with StoreNode(**cfg) as n:  # type: ignore[arg-type]
        for i, k in enumerate(keys):
            n.put(k, _block(i), namespace=NS)
        on_ssd = [k for k in keys if n.tier_of(k) is TierKind.SSD]
    assert len(on_ssd) >= 15
    with StoreNode(**cfg) as n:  # type: ignore[arg-type]
        assert n.exists(on_ssd) == [True] * len(on_ssd)
        stored = {e.key for e in n.take_events() if isinstance(e, BlockStored)}
        assert stored == set(on_ssd)
        i = keys.index(on_ssd[0])
        assert torch.equal(n.get(on_ssd[0], namespace=NS), _block(i))


def test_concurrent_readers_and_writers(node: StoreNode) -> None:
    keys = _keys(60)
    errors: list[BaseException] = []

    def writer(lo: int, hi: int) -> None:
        try:
            for i in range(lo, hi):
                node.put(keys[i], _block(i), namespace=NS)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            out = torch.empty(SHAPE)
            for _ in range(3):
                for i, k in enumerate(keys):
                    if node.get_into(k, out, namespace=NS):
                        assert torch.equal(out, _block(i))  # never wrong bytes
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=(0, 30)),
        threading.Thread(target=writer, args=(30, 60)),
        threading.Thread(target=reader),
        threading.Thread(target=reader),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    st = node.stats()
    lost = 60 - st["blocks"]
    assert lost == st["counters"].get("evictions_ssd", 0), st  # only evictions, no leaks


def test_evict_to_target(node: StoreNode) -> None:
    keys = _keys(15)
    for i, k in enumerate(keys):
        node.put(k, _block(i))
    with node.pin(keys[-1]):
        moved = node.evict(TierKind.DRAM, 0)
        assert node.tier_of(keys[-1]) is TierKind.DRAM
    assert moved == 14
    assert node.stats()["tiers"]["ssd"]["blocks"] == 14


def test_evict_where_plans_filters_and_skips_pins(node: StoreNode) -> None:
    from kvstore.node.eviction import BlockFilter

    keys = _keys(10)
    other = NS.with_tenant("u")
    for i, k in enumerate(keys):
        node.put(k, _block(i), namespace=NS if i < 6 else other)
    used = node.stats()["tiers"]["dram"]["used"]
    only_t = BlockFilter(namespaces=frozenset({NS.fingerprint()}))
    with node.pin(keys[0]):  # the oldest, so first in LRU order
        plan = node.evict_where(TierKind.DRAM, 0, only_t, dry_run=True, list_limit=3)
        assert (plan.demoted, plan.skipped_pinned, len(plan.blocks)) == (5, 1, 3)
        assert plan.next_tier == "ssd" and node.stats()["tiers"]["dram"]["used"] == used
        done = node.evict_where(TierKind.DRAM, 0, only_t)
        assert (done.demoted, done.dropped, done.skipped_pinned) == (5, 0, 1)
        assert done.nbytes == plan.nbytes
    assert [node.tier_of(k) for k in keys] == [TierKind.DRAM] + [TierKind.SSD] * 5 + [
        TierKind.DRAM
    ] * 4
    assert node.evict_where(TierKind.DRAM, 0, BlockFilter(idle_s=3600)).moved == 0
    prefix = BlockFilter(key_prefix=keys[7][:4])
    assert node.evict_where(TierKind.DRAM, 0, prefix).moved == 1
    dropped = node.evict_where(TierKind.SSD, 0, BlockFilter(namespaces=frozenset()))
    assert dropped.moved == 0  # an empty set of namespaces matches nothing
    assert node.evict_where(TierKind.SSD, 0).dropped == 6


def test_configured_shm_name_survives_a_crashed_predecessor(tmp_path: Path) -> None:
    """A node killed before it could unlink leaves its segment; a restart under the same
    configured name replaces it instead of failing to start."""
    import os

    name = f"kvstore-test-{os.getpid()}-restart"
    leftover = Path("/dev/shm") / name
    leftover.write_bytes(b"\xff" * 4096)  # what a SIGKILLed node leaves behind
    try:
        with StoreNode(node_id="r", dram_bytes=1 << 20, shm_name=name) as n:
            assert n.shm_name == name
            n.put(_keys(1)[0], _block(0))
            assert torch.equal(n.get(_keys(1)[0]), _block(0))
        assert not leftover.exists()  # a clean close unlinks it
    finally:
        leftover.unlink(missing_ok=True)
