"""The node's GPU copies on a CUDA device (issue 31, "The HBM tier" and items 3-4):
exact bytes on every path, no host hash or host copy where the issue forbids one, the
checksum rule (kvstore/tiers/hashbook.py) with real streams, and a real ``kvstore
serve`` whose top tier is HBM. tests/unit/test_hbm_deferred.py runs the same
bookkeeping on the host, without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.blocks import HEADER_SIZE, checksum
from kvstore.config import NodeConfig
from kvstore.copies.cuda import CudaCopyEngine
from kvstore.copies.engine import Batch
from kvstore.copies.registry import HostRegistry, clear_last_error
from kvstore.errors import CorruptBlock
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from kvstore.tiers import hbm
from tests.support.server_fixtures import ServerFactory

pytest_plugins = ["tests.support.server_fixtures"]
pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

MiB = 1 << 20


def _value(seed: int, nbytes: int = 4 * MiB) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    v = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    return v.view(torch.bfloat16).reshape(2, 2, 1, -1, 64)  # a bf16 block, any geometry


def _host_sum(t: torch.Tensor) -> int:
    return checksum(t.reshape(-1).view(torch.uint8).cpu().numpy())


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StoreNode]:
    cfg = NodeConfig(
        hbm_bytes=32 * MiB,
        dram_bytes=32 * MiB,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=128 * MiB,
        shm_name="",
    )
    with StoreNode(cfg) as n:
        yield n


class _Calls:
    """Calls of a function made on the test's own thread (the hasher's are its own)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        real = getattr(owner, name)
        self.n, me = 0, threading.get_ident()

        def counted(*args: Any, **kw: Any) -> Any:
            if threading.get_ident() == me:
                self.n += 1
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counted)


def test_hbm_put_and_get_into_are_one_device_copy_each(
    node: StoreNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = _Calls(monkeypatch, hbm, "land_hashed")
    staging = _Calls(monkeypatch, CudaCopyEngine, "staging")
    value = _value(1)
    assert node.put(b"a" * 16, value) is True
    out = torch.empty_like(value)
    assert node.get_into(b"a" * 16, out) is True
    assert hashes.n == 0 and staging.n == 0  # no host hash, no host buffer
    assert node.tier_of(b"a" * 16) is TierKind.HBM
    assert torch.equal(out.view(torch.uint8), value.view(torch.uint8))  # bytes, NaN-safe


def test_the_checksum_is_right_after_demotion_and_before_a_network_read(node: StoreNode) -> None:
    a, b = _value(2), _value(3)
    node.put(b"a" * 16, a)
    node.put(b"b" * 16, b)
    with node.pin(b"b" * 16) as blk:  # what the server sends: host bytes, then header
        assert blk is not None
        sent = blk.host()
        assert blk.header.checksum == checksum(sent) == _host_sum(b)
        assert blk.header.pack()
    assert node.evict(TierKind.HBM, 0) == 2
    for key, v in ((b"a" * 16, a), (b"b" * 16, b)):
        assert node.tier_of(key) is TierKind.DRAM
        assert node._index.state.entries[key].header.checksum == _host_sum(v)
        out = torch.empty_like(v)
        assert node.get_into(key, out) and torch.equal(out.view(torch.uint8), v.view(torch.uint8))


@pytest.mark.parametrize("leave", ["demotion", "read"])
def test_a_corrupted_hbm_byte_is_a_miss_when_the_block_leaves(node: StoreNode, leave: str) -> None:
    key = b"c" * 16
    node.put(key, _value(4))
    assert node.settle_checksums(10.0)
    place = node._index.state.entries[key].place
    node._tiers[0]._slab.tensor[place + HEADER_SIZE + 99] ^= 0x40  # a stray device write
    torch.cuda.synchronize()
    if leave == "demotion":
        node.evict(TierKind.HBM, 0)
    else:
        with node.pin(key) as blk:
            assert blk is not None
            with pytest.raises(CorruptBlock):
                blk.host()
    assert node.stats()["counters"]["corrupt_blocks_hbm"] == 1
    assert node.get(key) is None  # never the wrong bytes


@pytest.mark.parametrize("pin", [True, False])
def test_dram_put_from_and_get_into_cuda_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pin: bool
) -> None:
    with StoreNode(NodeConfig(dram_bytes=64 * MiB, shm_name="")) as n:
        dram = n._tiers[0]
        if not pin:  # registration failed: the pinned-staging fallback
            dram._unregister()
        assert dram.registered is pin, "cudaHostRegister of the DRAM slab failed"
        staging = _Calls(monkeypatch, CudaCopyEngine, "staging")
        for i, size in enumerate((1 * MiB, 4 * MiB, 16 * MiB)):
            v = _value(10 + i, size)
            key = bytes([i]) * 16
            assert n.put(key, v) is True
            assert n._index.state.entries[key].header.checksum == _host_sum(v)
            out = torch.empty_like(v)
            assert n.get_into(key, out) and torch.equal(out.view(torch.uint8), v.view(torch.uint8))
        assert (staging.n == 0) is pin  # registered: straight in and out of the slab


def test_the_copy_engine_orders_a_put_after_the_producer_stream(node: StoreNode) -> None:
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        v = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(50_000_000)  # the fill lands well after the put is enqueued
        v.fill_(7)
        assert node.put(b"o" * 16, v) is True
    out = torch.zeros_like(v)
    assert node.get_into(b"o" * 16, out)
    assert int(out.min()) == 7 == int(out.max())
    assert isinstance(node._tiers[0]._slab.engine, CudaCopyEngine)


class _Batches:
    """Copy batches begun and waited for on the test's own thread (the engine's stats
    also count the background hasher's, which starts 2 ms after a seal)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        me, begin, finish = threading.get_ident(), CudaCopyEngine.begin, Batch.finish
        self.begun = self.waited = 0

        def counted_begin(engine: CudaCopyEngine, *args: Any, **kw: Any) -> Any:
            self.begun += threading.get_ident() == me
            return begin(engine, *args, **kw)

        def counted_finish(batch: Batch) -> None:
            self.waited += threading.get_ident() == me and not batch._done
            finish(batch)

        monkeypatch.setattr(CudaCopyEngine, "begin", counted_begin)
        monkeypatch.setattr(Batch, "finish", counted_finish)

    def take(self) -> dict[str, int]:
        """Batches and waits since the last take."""
        out = {"batches": self.begun, "syncs": self.waited}
        self.begun = self.waited = 0
        return out


def test_an_hbm_batch_is_one_d2d_submission_and_one_wait(
    node: StoreNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = _Calls(monkeypatch, hbm, "land_hashed")
    staging = _Calls(monkeypatch, CudaCopyEngine, "staging")
    keys = [bytes([i]) * 16 for i in range(6)]
    values = [_value(40 + i, MiB) for i in range(6)]
    batches = _Batches(monkeypatch)
    assert node.batch_put(keys, values) == [True] * 6
    assert batches.take() == {"batches": 1, "syncs": 1}
    assert all(node.tier_of(k) is TierKind.HBM for k in keys)
    outs = [torch.empty_like(v) for v in values]
    assert node.batch_get_into(keys[::-1], outs[::-1]) == [True] * 6
    assert batches.take() == {"batches": 1, "syncs": 1}
    assert hashes.n == 0 and staging.n == 0  # no host hash, no host buffer
    for out, v in zip(outs, values, strict=True):
        assert torch.equal(out.view(torch.uint8), v.view(torch.uint8))
    assert node.settle_checksums(10.0)  # the hasher's first checksums, then a departure
    with node.pin(keys[2]) as blk:
        assert blk is not None and checksum(blk.host()) == _host_sum(values[2])


@pytest.mark.parametrize("pin", [True, False])
def test_a_dram_batch_from_and_into_cuda_is_one_submission(
    monkeypatch: pytest.MonkeyPatch, pin: bool
) -> None:
    with StoreNode(NodeConfig(dram_bytes=64 * MiB, shm_name="")) as n:
        dram = n._tiers[0]
        if not pin:
            dram._unregister()
        assert dram.registered is pin, "cudaHostRegister of the DRAM slab failed"
        staging = _Calls(monkeypatch, CudaCopyEngine, "staging")
        keys = [bytes([i]) * 16 for i in range(8)]
        values = [_value(50 + i, (1 + i % 3) * MiB) for i in range(8)]
        batches = _Batches(monkeypatch)
        assert n.batch_put(keys, values) == [True] * 8
        assert batches.take() == {"batches": 1, "syncs": 1}
        for k, v in zip(keys, values, strict=True):
            assert n._index.state.entries[k].header.checksum == _host_sum(v)
        outs = [torch.empty_like(v) for v in values]
        assert n.batch_get_into(keys, outs) == [True] * 8
        assert batches.take() == {"batches": 1, "syncs": 1}
        for out, v in zip(outs, values, strict=True):
            assert torch.equal(out.view(torch.uint8), v.view(torch.uint8))
        assert (staging.n == 0) is pin  # registered: straight in and out of the slab


def test_dram_copies_across_registered_chunk_boundaries_are_exact() -> None:
    with StoreNode(NodeConfig(dram_bytes=64 * MiB, shm_name="")) as n:
        dram = n._tiers[0]
        dram._unregister()  # registered again below, with 1 MiB chunks
        small = HostRegistry(lambda: torch.cuda.cudart(), chunk=MiB, clear=clear_last_error)
        dram.use_copies(registry=small)
        assert dram.registered and len(dram._link.reg.chunks) == -(-dram.capacity // MiB)
        keys = [bytes([i]) * 16 for i in range(8)]
        values = [_value(60 + i, 3 * MiB // 2) for i in range(8)]  # most straddle a chunk
        assert n.batch_put(keys[:4], values[:4]) == [True] * 4
        assert all(n.put(k, v) for k, v in zip(keys[4:], values[4:], strict=True))
        outs = [torch.empty_like(v) for v in values]
        assert n.batch_get_into(keys[:4], outs[:4]) == [True] * 4
        assert all(n.get_into(k, o) for k, o in zip(keys[4:], outs[4:], strict=True))
        for k, out, v in zip(keys, outs, values, strict=True):
            assert torch.equal(out.view(torch.uint8), v.view(torch.uint8))
            assert n._index.state.entries[k].header.checksum == _host_sum(v)


@pytest.mark.process
def test_an_hbm_node_takes_same_host_puts_and_serves_tcp_reads(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(hbm_bytes="64MiB")
    values = [np.random.default_rng(i).integers(0, 256, MiB, dtype=np.uint8) for i in range(3)]
    with server.client() as c:  # transport auto: shared memory, into DRAM
        assert c.batch_put([b"s" * 16, b"t" * 16], values[:2]) == [True, True]
        assert c.transport == "shm"
    with server.client(transport="tcp") as c:  # over the socket: into HBM, out of it
        assert c.put(b"u" * 16, values[2]) is True
        for key, v in zip((b"s" * 16, b"t" * 16, b"u" * 16), values, strict=True):
            out = np.zeros_like(v)
            assert c.get_into(key, out) is True and np.array_equal(out, v)
        tiers = c.stats()["tiers"]
    assert tiers["hbm"]["blocks"] == 1 and tiers["dram"]["blocks"] == 2
