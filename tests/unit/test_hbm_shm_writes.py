"""Same-host writes to a node whose top tier is HBM (issue 31, item 4): the gateway
reserves them in the shared DRAM segment, the one memory a same-host client maps, so
a put with the client's default transport succeeds; the block is verified against the
client's checksum and stays in DRAM, where the same host's readers copy from it. Only
a node that shares no memory refuses. The HBM tier here is its code on host memory
(``hbm_device="cpu"``); tests/gpu/test_tiers_cuda.py does it with CUDA and a real
``kvstore serve``, tests/service/test_hbm_same_host.py with a real server on CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.blocks import HEADER_SIZE, checksum, describe
from kvstore.config import NodeConfig, ServerConfig
from kvstore.errors import StorageError
from kvstore.node.store import StoreNode
from kvstore.server.gateway import Gateway
from kvstore.server.leases import Lease
from kvstore.server.shm_writes import CommitItem, CreditBind
from kvstore.server.write_batch import WriteItem
from kvstore.shm.segment import map_segment
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind

LAYOUT = "float32:L1:H1:D16:B16"
VALUE = np.arange(2 * 16 * 16, dtype=np.float32).reshape(1, 2, 1, 16, 16)  # 2 KiB
ALPHA = Principal("alpha")


def _gateway(tmp_path: Path, *, shared: bool) -> Iterator[Gateway]:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tokens]]\ntoken = "alpha-token-0123456789"\ntenant = "alpha"\n')
    cfg = NodeConfig(
        hbm_bytes=1 << 20, hbm_device="cpu", dram_bytes=1 << 20, shared_dram=shared, warm=False
    )
    with StoreNode(cfg) as node:
        gw = Gateway(node, ServerConfig(port=0, tokens_file=str(tokens)))
        try:
            yield gw
        finally:
            gw.close()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(tmp_path, shared=True)


def _fill(gw: Gateway, offset: int, value: np.ndarray) -> None:
    """Copy ``value`` into the shared segment at ``offset``, as a same-host client does."""
    mm = map_segment(gw.shm_name, gw.node.stats()["tiers"]["dram"]["capacity"], create=False)
    try:
        seg = np.frombuffer(mm, dtype=np.uint8)
        start = offset + HEADER_SIZE
        seg[start : start + value.nbytes] = value.reshape(-1).view(np.uint8)
        del seg
    finally:
        with contextlib.suppress(BufferError):
            mm.close()


def test_a_reserved_same_host_write_lands_in_dram_below_hbm(gateway: Gateway) -> None:
    assert gateway.node.tiers == (TierKind.HBM, TierKind.DRAM)
    key = b"s" * 16
    item = WriteItem(key, describe(VALUE), 0, VALUE.nbytes)
    (lease,) = gateway.reserve_leased(ALPHA, "m", LAYOUT, [item], owner=1)
    assert isinstance(lease, Lease), lease
    assert lease.obj.shm_offset >= 0  # an extent of the segment the client maps
    _fill(gateway, lease.obj.shm_offset, VALUE)
    assert gateway.commit_leased(ALPHA, [CommitItem(lease.id, checksum(VALUE))]) == [True]
    scoped = ALPHA.scope(key)
    assert gateway.node.tier_of(scoped) is TierKind.DRAM
    out = np.zeros_like(VALUE)
    assert gateway.node.get_into(scoped, out) and np.array_equal(out, VALUE)


def test_a_same_host_write_with_a_wrong_checksum_is_refused_below_hbm(gateway: Gateway) -> None:
    item = WriteItem(b"w" * 16, describe(VALUE), 0, VALUE.nbytes)
    (lease,) = gateway.reserve_leased(ALPHA, "m", LAYOUT, [item], owner=1)
    assert isinstance(lease, Lease)
    _fill(gateway, lease.obj.shm_offset, VALUE)
    (out,) = gateway.commit_leased(ALPHA, [CommitItem(lease.id, checksum(VALUE) ^ 1)])
    assert isinstance(out, Exception) and "checksum" in str(out)
    assert gateway.node.exists([ALPHA.scope(b"w" * 16)]) == [False]


def test_write_credits_are_lent_in_dram_below_hbm(gateway: Gateway) -> None:
    (credit,) = gateway.lend_credits(ALPHA, "m", LAYOUT, [VALUE.nbytes], owner=2)
    assert credit.obj.shm_offset >= 0
    _fill(gateway, credit.obj.shm_offset, VALUE)
    bind = CreditBind(credit.id, checksum(VALUE), b"c" * 16, describe(VALUE))
    assert gateway.commit_leased(ALPHA, [bind], "m", LAYOUT, owner=2) == [True]
    assert gateway.node.tier_of(ALPHA.scope(b"c" * 16)) is TierKind.DRAM


def test_a_node_that_shares_no_memory_refuses_same_host_writes(tmp_path: Path) -> None:
    for gw in _gateway(tmp_path, shared=False):
        item = WriteItem(b"p" * 16, describe(VALUE), 0, VALUE.nbytes)
        (out,) = gw.reserve_leased(ALPHA, "m", LAYOUT, [item], owner=1)
        assert isinstance(out, StorageError) and "data socket" in str(out)
        assert gw.lend_credits(ALPHA, "m", LAYOUT, [VALUE.nbytes], owner=1) == []
        assert gw.node.stats()["tiers"]["hbm"]["used"] == 0  # nothing left reserved
