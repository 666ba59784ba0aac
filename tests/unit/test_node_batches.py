"""A node's batches of device puts and reads as one submission (kvstore/node/batches.py),
on CPU through the host copy engine, which runs a copy only when an event after it is
waited for, as a stream would: the HBM tier over host memory (``hbm_device="cpu"``) and
the DRAM tier with CPU tensors routed through its device path (``use_copies``), its
slab registered in a test registry with small chunks. One batch and one wait per call,
exact bytes, reservations invisible and pins held until the wait, a copy failing in
the middle of a batch aborting only what it must, and straight copies cut at the
registry's chunk boundaries. tests/gpu/test_tiers_cuda.py runs the batches on CUDA."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.blocks import checksum
from kvstore.config import NodeConfig
from kvstore.copies.engine import Batch
from kvstore.copies.host import HostCopyEngine, _HostBatch
from kvstore.copies.registry import HostRegistry
from kvstore.errors import DeviceError
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from tests.support.cudart import RecordingCudart

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 48 * KiB  # with its header, extents straddle 64 KiB chunks often


def _values(n: int, seed: int = 0, nbytes: int = BLOCK) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


class Engine(HostCopyEngine):
    """The host engine, with hooks: ``before_run`` fires once, when a batch is first
    waited for (every copy queued, none run); ``fail_queue`` / ``fail_run``: the n-th
    copy (0-based, over the engine's life) raises DeviceError as it is queued (once) /
    every time it is run; ``copies`` keeps each copy's (dst, src) numpy views."""

    def __init__(self) -> None:
        super().__init__()
        self.before_run: Callable[[], None] | None = None
        self.fail_queue: int | None = None
        self.fail_run: int | None = None
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []

    def begin(self, device: Any, *, after_caller: bool = True, after_slab: bool = False) -> Batch:
        self.stats["batches"] += 1
        return _Batch(self)


class _Batch(_HostBatch):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.hooks = engine
        self.first: int = len(engine.copies)  # the engine-wide number of queue[0]

    def _add(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        e = self.hooks
        if e.fail_queue is not None and e.fail_queue in range(
            len(e.copies), len(e.copies) + len(dsts)
        ):
            e.fail_queue = None  # once: the next item's copy takes the same number
            raise DeviceError("an illegal address while queueing (injected)")
        super()._add(dsts, srcs)
        e.copies.extend(self._queue[len(self._queue) - len(dsts) :])

    def _run(self, upto: int) -> None:
        e = self.hooks
        if e.before_run is not None:
            hook, e.before_run = e.before_run, None
            hook()
        if e.fail_run is not None and self._ran <= e.fail_run - self.first < upto:
            super()._run(e.fail_run - self.first)
            raise DeviceError("an illegal address in a copy (injected)")
        super()._run(upto)


@pytest.fixture
def hbm(tmp_path: Path) -> Iterator[StoreNode]:
    cfg = NodeConfig(hbm_bytes=2 * MiB, hbm_device="cpu", dram_bytes=4 * MiB, warm=False)
    with StoreNode(cfg, shm_name="") as n:
        _quiet(n)
        yield n


def _quiet(node: StoreNode) -> Engine:
    """The HBM slab on the hooked engine, its background hasher stopped (its copies
    would interleave with the test's; departures still take first checksums)."""
    slab = node._tiers[0]._slab
    slab._hasher.close()
    slab.engine = Engine()
    return slab.engine


def _engine(node: StoreNode) -> Engine:
    tier = node._tiers[0]
    engine = tier._slab.engine if tier.kind is TierKind.HBM else tier._link.fixed
    assert isinstance(engine, Engine)
    return engine


def _dram_node(registered: bool = True, chunk: int = 64 * KiB) -> StoreNode:
    node = StoreNode(NodeConfig(dram_bytes=4 * MiB, warm=False), shm_name="")
    rt = RecordingCudart(fail_at=None if registered else 0)
    node._tiers[0].use_copies(Engine(), HostRegistry(lambda: rt, chunk=chunk))
    assert node._tiers[0].registered is registered
    return node


@pytest.fixture
def dram() -> Iterator[StoreNode]:
    with _dram_node() as n:
        yield n


def _fresh(node: StoreNode) -> Engine:
    engine = _engine(node)
    engine.stats = dict.fromkeys(engine.stats, 0)
    return engine


@pytest.mark.parametrize("tier", ["hbm", "dram", "dram_staged"])
def test_a_batch_is_one_submission_one_wait_and_exact_bytes(hbm: StoreNode, tier: str) -> None:
    node = hbm if tier == "hbm" else _dram_node(registered=tier == "dram")
    try:
        keys, values = _keys(8), _values(8)
        engine = _fresh(node)
        assert node.batch_put(keys, values) == [True] * 8
        assert engine.stats["batches"] == 1 and engine.stats["syncs"] == 1
        assert engine.stats["copies"] >= 8
        assert all(node.tier_of(k) is node.tiers[0] for k in keys)
        headers = [node._index.state.entries[k].header for k in keys]
        if tier == "hbm":  # the checksum rule: pending until a departure (or the hasher)
            assert all(h.pending for h in headers)
            with node.pin(keys[3]) as blk:
                assert blk is not None and blk.host() is not None
                assert blk.header.checksum == checksum(values[3].numpy())
        else:  # hashed from the host bytes as each landed
            assert [h.checksum for h in headers] == [checksum(v.numpy()) for v in values]
        engine = _fresh(node)
        outs = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(8)]
        assert node.batch_get_into(keys[::-1], outs) == [True] * 8
        assert engine.stats["batches"] == 1 and engine.stats["syncs"] == 1
        for out, v in zip(outs, values[::-1], strict=True):
            assert torch.equal(out, v)
    finally:
        if node is not hbm:
            node.close()


@pytest.mark.parametrize("tier", ["hbm", "dram"])
def test_puts_stay_invisible_and_reads_pinned_until_the_wait(
    hbm: StoreNode, dram: StoreNode, tier: str
) -> None:
    node = hbm if tier == "hbm" else dram
    keys, values = _keys(4), _values(4, seed=1)
    engine = _engine(node)
    seen: dict[str, Any] = {}
    engine.before_run = lambda: seen.update(visible=node.exists(keys))
    assert node.batch_put(keys, values) == [True] * 4
    assert seen["visible"] == [False] * 4  # reserved, not committed, until their copies ran
    outs = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(4)]

    def at_the_wait() -> None:
        seen["pinned"] = node.stats()["pinned"]
        seen["untouched"] = not any(bool(o.any()) for o in outs)

    engine.before_run = at_the_wait
    assert node.batch_get_into(keys, outs) == [True] * 4
    assert seen["pinned"] == 4 and seen["untouched"]
    assert node.stats()["pinned"] == 0
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))


def test_a_dram_copy_failing_as_it_runs_aborts_it_and_what_follows(dram: StoreNode) -> None:
    keys, values = _keys(6), _values(6, seed=2)
    engine = _engine(dram)
    engine.fail_run = len(engine.copies) + 3  # a block, or a piece of one, mid-batch
    got = dram.batch_put(keys, values)
    failed = next(i for i, r in enumerate(got) if r is not True)
    assert got[:failed] == [True] * failed and failed <= 3
    assert all(isinstance(r, DeviceError) for r in got[failed:])
    assert dram.exists(keys) == [True] * failed + [False] * (6 - failed)  # nothing wrong
    engine.fail_run = None
    outs = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(failed)]
    assert dram.batch_get_into(keys[:failed], outs) == [True] * failed
    assert all(torch.equal(o, v) for o, v in zip(outs, values[:failed], strict=True))
    assert dram.stats()["tiers"]["dram"]["blocks"] == failed
    assert dram.batch_put(keys, values)[failed:] == [True] * (6 - failed)  # space came back


def test_a_copy_failing_as_it_is_queued_fails_only_its_item(hbm: StoreNode) -> None:
    keys, values = _keys(5), _values(5, seed=3)
    engine = _engine(hbm)
    engine.fail_queue = len(engine.copies) + 2
    got = hbm.batch_put(keys, values)
    assert [r is True for r in got] == [True, True, False, True, True]
    assert isinstance(got[2], DeviceError)
    assert hbm.exists(keys) == [True, True, False, True, True]
    engine.fail_queue = len(engine.copies) + 1  # a read's copy, the second block's
    outs = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(5)]
    got = hbm.batch_get_into(keys, outs)
    assert got[0] is True and isinstance(got[1], DeviceError) and got[2] is False
    assert got[3:] == [True, True] and hbm.stats()["pinned"] == 0
    assert torch.equal(outs[3], values[3]) and not outs[1].any()


def test_an_hbm_batch_whose_wait_fails_commits_none_of_it(hbm: StoreNode) -> None:
    keys, values = _keys(4), _values(4, seed=4)
    engine = _engine(hbm)
    engine.fail_run = len(engine.copies) + 2
    got = hbm.batch_put(keys, values)
    assert all(isinstance(r, DeviceError) for r in got)
    assert hbm.exists(keys) == [False] * 4 and hbm._tiers[0].used == 0
    engine.fail_run = None
    assert hbm.batch_put(keys, values) == [True] * 4  # the space came back


def test_outcomes_per_key_as_one_by_one(hbm: StoreNode) -> None:
    keys, values = _keys(5), _values(5, seed=5)
    mixed: list[Any] = [values[0], values[1].numpy(), values[0], b"x" * (4 * MiB), values[4]]
    got = hbm.batch_put([keys[0], keys[1], keys[0], keys[3], keys[4]], mixed)
    assert got[:3] == [True, True, False] and got[4] is True  # a duplicate key: False
    assert type(got[3]).__name__ == "BlockTooLarge"
    out = np.zeros(BLOCK, dtype=np.uint8)  # a host buffer: a departure, copied at once
    assert hbm.batch_get_into([keys[1], b"m" * 16], [out, out.copy()]) == [True, False]
    assert np.array_equal(out, values[1].numpy())


def test_a_batch_larger_than_the_tier_demotes_as_puts_one_by_one(hbm: StoreNode) -> None:
    n = 2 * MiB // (256 * KiB) + 4  # more blocks than the HBM tier holds
    keys, values = _keys(n, tag=9), _values(n, seed=6, nbytes=256 * KiB)
    assert hbm.batch_put(keys, values) == [True] * n
    tiers = [hbm.tier_of(k) for k in keys]
    assert TierKind.DRAM in tiers and tiers[-1] is TierKind.HBM
    outs = [torch.zeros(256 * KiB, dtype=torch.uint8) for _ in range(n)]
    assert hbm.batch_get_into(keys, outs) == [True] * n
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))


# -- the registration's chunks ----------------------------------------------------------


def _in_one_chunk(node: StoreNode, engine: Engine) -> int:
    """How many copies touched the slab; asserts each lies within one chunk."""
    tier = node._tiers[0]
    reg, slab = tier._link.reg, tier._host
    base, end = int(slab.ctypes.data), int(slab.ctypes.data) + slab.nbytes
    n = 0
    for dst, src in engine.copies:
        for side in (dst, src):
            at = int(side.ctypes.data)
            if base <= at < end:
                n += 1
                first = (at - reg.base) // reg.chunk
                last = (at + side.nbytes - 1 - reg.base) // reg.chunk
                assert first == last, f"a copy of {side.nbytes} bytes crosses a chunk"
    return n


@pytest.mark.parametrize("batched", [True, False])
def test_straight_copies_are_cut_at_registered_chunks(dram: StoreNode, batched: bool) -> None:
    n = 16
    keys, values = _keys(n, tag=7), _values(n, seed=7)
    engine = _engine(dram)
    if batched:
        assert dram.batch_put(keys, values) == [True] * n
    else:
        assert all(dram.put(k, v) for k, v in zip(keys, values, strict=True))
    places = [dram._index.state.entries[k].place for k in keys]
    chunk = dram._tiers[0]._link.reg.chunk
    straddle = sum((p + 128) // chunk != (p + 128 + BLOCK - 1) // chunk for p in places)
    assert straddle >= 2  # the test covers extents across a boundary
    assert _in_one_chunk(dram, engine) >= n + straddle
    outs = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]
    engine.copies.clear()
    if batched:
        assert dram.batch_get_into(keys, outs) == [True] * n
    else:
        assert all(dram.get_into(k, o) for k, o in zip(keys, outs, strict=True))
    assert _in_one_chunk(dram, engine) == n + straddle
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))
    assert [dram._index.state.entries[k].header.checksum for k in keys] == [
        checksum(v.numpy()) for v in values
    ]


def test_a_demotion_into_registered_dram_is_cut_at_chunks(tmp_path: Path) -> None:
    cfg = NodeConfig(hbm_bytes=2 * MiB, hbm_device="cpu", dram_bytes=4 * MiB, warm=False)
    with StoreNode(cfg, shm_name="") as node:
        engine = _quiet(node)
        dram = node._tiers[1]
        dram.use_copies(registry=HostRegistry(RecordingCudart, chunk=64 * KiB))
        keys, values = _keys(12, tag=8), _values(12, seed=8)
        assert node.batch_put(keys, values) == [True] * 12
        assert node.evict(TierKind.HBM, 0) == 12
        reg = dram._link.reg
        slab = dram._host
        base = int(slab.ctypes.data)
        into = [d for d, _ in engine.copies if base <= int(d.ctypes.data) < base + slab.nbytes]
        assert into and all(
            (int(d.ctypes.data) - reg.base) // reg.chunk
            == (int(d.ctypes.data) + d.nbytes - 1 - reg.base) // reg.chunk
            for d in into
        )
        for k, v in zip(keys, values, strict=True):
            got = node.get(k)
            assert got is not None and bytes(got.numpy()) == bytes(v.numpy())
