"""The HBM tier's checksum rule, on the host (issue 31, "The HBM tier"): the tier's own
code over host memory (``hbm_device="cpu"``, kvstore/copies/host.py HostCopyEngine), so
the deferred-hash bookkeeping, the departures and the copy pipeline run here exactly
as they run on a GPU; tests/gpu/test_tiers_cuda.py runs them on CUDA.

The rule (kvstore/tiers/hashbook.py): a put from a tensor is one copy and commits with
its checksum pending; the background hasher, or the block's first departure from the
device, takes the first checksum; every departure hashes and checks; a mismatch is a
miss, a counter and a dropped block, never bytes handed on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.blocks import HEADER_SIZE, PENDING, BlockHeader, ValueInfo, checksum
from kvstore.config import NodeConfig
from kvstore.copies import landing
from kvstore.errors import CorruptBlock, StorageError
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from kvstore.tiers.hashbook import HashBook

MiB = 1 << 20


def _block(seed: int, nbytes: int = MiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _header(n: int, csum: int = PENDING) -> BlockHeader:
    return BlockHeader("uint8", (n,), 0, b"k" * 16, b"\x00" * 16, n, csum)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StoreNode]:
    cfg = NodeConfig(
        hbm_bytes=8 * MiB,
        hbm_device="cpu",
        dram_bytes=8 * MiB,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=64 * MiB,
        warm=False,
        shm_name="",
    )
    with StoreNode(cfg) as n:
        yield n


def _hbm(node: StoreNode) -> Any:
    return node._tiers[0]  # the tier itself: its slab is what a stray write corrupts


def _corrupt(node: StoreNode, key: bytes) -> None:
    e = node._index.state.entries[key]
    _hbm(node)._slab.tensor[e.place + HEADER_SIZE + 7] ^= 0xFF


# -- the bookkeeping ------------------------------------------------------------------


def test_the_first_departure_of_a_pending_block_sets_its_checksum_and_later_ones_check_it() -> None:
    book = HashBook()
    book.sealed(0, 64, PENDING)
    h = book.settle(0, _header(64), 1234)
    assert h.checksum == 1234 and book.first_by_departure == 1 and book.pending() == 0
    assert book.settle(0, _header(64), 1234).checksum == 1234  # the header learns it
    with pytest.raises(CorruptBlock, match="hash to"):
        book.settle(0, _header(64), 999)


def test_a_hash_taken_for_a_released_place_is_never_recorded_for_its_next_block() -> None:
    book = HashBook()
    stop = threading.Event()
    book.sealed(256, 64, PENDING)
    taken = book.take(stop, quiet_s=0.0)
    assert taken is not None
    place, gen, _n = taken
    book.forget(place)  # released while the hasher copied it ...
    book.sealed(place, 64, PENDING)  # ... and reused by another block
    book.record(place, gen, 42)
    assert book.pending() == 1  # the new block is still pending: 42 was the old one's
    nxt = book.take(stop, quiet_s=0.0)
    assert nxt is not None and nxt[1] != gen
    book.record(nxt[0], nxt[1], 43)
    assert book.pending() == 0 and book.first_by_hasher == 1 and book.drained(1.0)


def test_a_pending_header_refuses_to_be_packed() -> None:
    with pytest.raises(StorageError, match="pending"):
        _header(64).pack()
    assert len(_header(64, 5).pack()) == HEADER_SIZE


# -- the node ---------------------------------------------------------------------------


def test_an_hbm_put_hashes_nothing_on_its_thread_and_the_hasher_settles_it(
    node: StoreNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    me, calls = threading.get_ident(), []
    real = landing.land_hashed

    def counted(*args: Any, **kw: Any) -> int:
        calls.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr("kvstore.tiers.hbm.land_hashed", counted)
    value = _block(1)
    assert node.put(b"a" * 16, value) is True
    assert me not in calls  # nothing copied to the host to hash it on the put's thread
    assert node._index.state.entries[b"a" * 16].header.pending
    assert node.settle_checksums(5.0)
    assert _hbm(node)._slab.book.first_by_hasher == 1
    out = torch.empty(MiB, dtype=torch.uint8)
    assert node.get_into(b"a" * 16, out) and torch.equal(out, value)


def test_a_demoted_block_carries_the_checksum_of_its_bytes(node: StoreNode) -> None:
    value = _block(2)
    node.put(b"b" * 16, value)
    assert node.evict(TierKind.HBM, 0) == 1
    assert node.tier_of(b"b" * 16) is TierKind.DRAM
    header = node._index.state.entries[b"b" * 16].header
    assert header.checksum == checksum(value.numpy())
    assert node.evict(TierKind.DRAM, 0) == 1  # to SSD: its header packs, its reads verify
    got = node.get(b"b" * 16)
    assert got is not None and torch.equal(got, value)


def test_a_network_read_of_a_pending_block_takes_its_first_checksum(node: StoreNode) -> None:
    value = _block(3)
    node.put(b"c" * 16, value)
    with node.pin(b"c" * 16) as blk:
        assert blk is not None
        host = blk.host()  # what the server sends
        assert blk.header.checksum == checksum(host) == checksum(value.numpy())
        assert blk.header.pack()  # its header now packs


@pytest.mark.parametrize("leave", ["demotion", "read", "get_into_host"])
def test_a_corrupted_device_byte_is_caught_as_the_block_leaves(node: StoreNode, leave: str) -> None:
    key = b"d" * 16
    node.put(key, _block(4))
    assert node.settle_checksums(5.0)  # its first checksum, from the bytes as put
    _corrupt(node, key)
    if leave == "demotion":
        node.evict(TierKind.HBM, 0)
    elif leave == "read":
        with node.pin(key) as blk:
            assert blk is not None
            with pytest.raises(CorruptBlock):
                blk.host()
    else:
        # a host buffer (a CPU tensor beside a slab over host memory is an in-device read)
        assert node.get_into(key, np.empty(MiB, dtype=np.uint8)) is False
    assert node.stats()["counters"]["corrupt_blocks_hbm"] == 1
    assert node.get(key) is None and node.exists([key]) == [False]  # a miss, for good


def test_hbm_straight_to_ssd_settles_the_checksum_on_the_way(tmp_path: Path) -> None:
    cfg = NodeConfig(
        hbm_bytes=4 * MiB,
        hbm_device="cpu",
        dram_bytes=0,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=32 * MiB,
        warm=False,
    )
    with StoreNode(cfg) as n:
        value = _block(5)
        n.put(b"e" * 16, value)
        n.evict(TierKind.HBM, 0)
        assert n.tier_of(b"e" * 16) is TierKind.SSD
        got = n.get(b"e" * 16)
        assert got is not None and torch.equal(got, value)


def test_a_writer_checksum_into_hbm_is_verified_at_commit(node: StoreNode) -> None:
    value = _block(6)
    info = ValueInfo("uint8", (MiB,), 0, MiB)
    res = node.reserve(b"f" * 16, info)
    assert res is not None
    res.write(value)
    with pytest.raises(CorruptBlock):
        node.commit(res, expected_checksum=checksum(value.numpy()) ^ 1)
    res = node.reserve(b"f" * 16, info)
    assert res is not None
    res.write(value)
    assert node.commit(res, expected_checksum=checksum(value.numpy()))
    assert node._index.state.entries[b"f" * 16].header.checksum == checksum(value.numpy())
