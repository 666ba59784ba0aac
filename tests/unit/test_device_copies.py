"""The client's device paths' batching, staging and ordering logic (kvstore/client/device/),
run on CPU through the host copy engine (kvstore/copies/host.py), which runs a copy only
when an event after it is waited for, as a stream would: one submission and one wait per
batch, staging slots reused only after their copy, slot checks of a direct read only
after the copies, and a block rewritten during a direct read never reported as read. The
engines and the staging ring themselves: tests/unit/test_copies_engine.py."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.blocks import HEADER_SIZE, BlockHeader, describe
from kvstore.client.device.reads import DeviceRead
from kvstore.client.device.writes import DeviceWrite
from kvstore.client.transport.shm_direct import FALLBACK, DirectReader
from kvstore.copies.engine import Batch
from kvstore.copies.host import HostCopyEngine
from kvstore.copies.registry import HostRegistry
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexReader, IndexWriter, index_name, reader_supported
from kvstore.shm.segment import SHM_DIR, map_segment
from kvstore.tenants import Principal
from tests.support.cudart import RecordingCudart

BLOCK = 64 << 10


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_a_gathered_read_is_one_submission_and_one_wait() -> None:
    engine = HostCopyEngine()
    segment = np.random.default_rng(1).integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    reg = HostRegistry(RecordingCudart).register(segment.ctypes.data, segment.size)
    outs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(8)]
    with DeviceRead(engine, segment, reg) as landing:
        for i, out in enumerate(outs):
            landing.from_segment(out, (7 - i) * BLOCK, BLOCK)
        assert engine.stats["copies"] == 0  # gathered until submit/finish
        landing.finish()
    assert engine.stats == {"batches": 1, "copies": 8, "syncs": 1, "waits": 1}
    assert landing.staged_bytes == 0  # straight from the segment
    for i, out in enumerate(outs):
        assert bytes(out.numpy()) == bytes(segment[(7 - i) * BLOCK : (8 - i) * BLOCK])


def test_an_unregistered_segment_stages_through_a_bounded_ring() -> None:
    engine = HostCopyEngine()
    segment = np.random.default_rng(2).integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    failed = HostRegistry(RecordingCudart, chunk=BLOCK)
    failed_reg = HostRegistry(lambda: RecordingCudart(fail_at=0)).register(1 << 30, BLOCK)
    assert failed.chunk == BLOCK and not failed_reg.pinned
    outs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(8)]
    allocated: list[int] = []
    staging = engine.staging

    def counted(n: int):  # type: ignore[no-untyped-def]
        allocated.append(n)
        return staging(n)

    engine.staging = counted  # type: ignore[method-assign]
    with DeviceRead(engine, segment, failed_reg, slots=2) as landing:
        for i, out in enumerate(outs):
            landing.from_segment(out, i * BLOCK, BLOCK)
    assert len(allocated) == 2  # two slots, reused after their copies' events
    assert landing.staged_bytes == 8 * BLOCK
    assert engine.stats["syncs"] == 1
    for i, out in enumerate(outs):
        assert bytes(out.numpy()) == bytes(segment[i * BLOCK : (i + 1) * BLOCK])


def test_a_rejected_receive_copies_nothing() -> None:
    engine = HostCopyEngine()
    out = torch.zeros(8, dtype=torch.uint8)
    with DeviceRead(engine) as landing:
        assert not landing.receive(out, 8, lambda view: view.fill(7) is not None)
    assert not out.any() and engine.stats["copies"] == 0


def test_leaving_a_read_by_an_exception_still_waits_for_its_copies() -> None:
    engine = HostCopyEngine()
    segment = np.full(BLOCK, 9, dtype=np.uint8)
    reg = HostRegistry(RecordingCudart).register(segment.ctypes.data, segment.size)
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    with pytest.raises(KeyError), DeviceRead(engine, segment, reg) as landing:
        landing.from_segment(out, 0, BLOCK)
        landing.submit()
        raise KeyError("a failure mid-call")
    assert engine.stats["syncs"] == 1  # nothing left in flight into the caller's tensor


@pytest.mark.parametrize("registered", [True, False])
def test_puts_yield_each_item_in_order_once_copied(registered: bool) -> None:
    engine = HostCopyEngine()
    segment = np.zeros(6 * BLOCK, dtype=np.uint8)
    cudart = RecordingCudart(fail_at=None if registered else 0)
    reg = HostRegistry(lambda: cudart).register(segment.ctypes.data, segment.size)
    values = [torch.full((BLOCK,), i + 1, dtype=torch.uint8) for i in range(5)]
    offsets = [i * BLOCK for i in range(5)]
    seen = []
    with DeviceWrite(engine, values, offsets, segment, reg, slots=2) as writes:
        for i, view, landed in writes.items():
            assert landed is registered
            assert bytes(view) == bytes([i + 1]) * BLOCK  # its copy is done
            if not landed:
                segment[offsets[i] : offsets[i] + BLOCK] = view
            seen.append(i)
    assert seen == [0, 1, 2, 3, 4]
    assert engine.stats["batches"] == 1 and engine.stats["syncs"] == 1
    assert bytes(segment[: 5 * BLOCK]) == b"".join(bytes([i + 1]) * BLOCK for i in range(5))


class RacingEngine(HostCopyEngine):
    """The host engine with a hook run when a batch is first waited for: after every
    copy was queued, before any ran (what a writer racing an async copy looks like)."""

    def __init__(self, before_copies) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.before_copies = before_copies

    def begin(
        self, device: object, *, after_caller: bool = True, after_slab: bool = False
    ) -> Batch:
        batch = super().begin(device, after_caller=after_caller, after_slab=after_slab)
        run = batch._run  # type: ignore[attr-defined]
        hook = self

        def racing(upto: int) -> None:
            if hook.before_copies is not None:
                fire, hook.before_copies = hook.before_copies, None
                fire()
            run(upto)

        batch._run = racing  # type: ignore[attr-defined]
        return batch


class Published:
    """A DRAM segment and its published index, written here as the server would."""

    def __init__(self, root: Path) -> None:
        self.name = f"kvstore-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.size = 1 << 20
        self.mm = map_segment(self.name, self.size, create=True)
        self.view = np.frombuffer(self.mm, dtype=np.uint8)
        self.index = IndexWriter(self.name, self.size)
        self.principal = Principal("alpha")
        self.at = 0

    def put(self, key: bytes, value: torch.Tensor) -> tuple[bytes, int]:
        skey = self.principal.scope_all([key])[0]
        payload = value.reshape(-1).view(torch.uint8).numpy()
        header = BlockHeader.for_value(skey, describe(value), payload)
        off = self.at
        self.view[off : off + HEADER_SIZE] = np.frombuffer(header.pack(), dtype=np.uint8)
        self.view[off + HEADER_SIZE : off + HEADER_SIZE + payload.size] = payload
        self.index.publish(skey, off)
        self.at += HEADER_SIZE + payload.size
        return skey, off

    def close(self) -> None:
        self.index.close()
        del self.view
        with contextlib.suppress(BufferError):  # a reader's view may linger
            self.mm.close()
        Path(SHM_DIR, self.name).unlink(missing_ok=True)
        Path(SHM_DIR, index_name(self.name)).unlink(missing_ok=True)


@pytest.fixture
def published(tmp_path: Path) -> Iterator[Published]:
    if not reader_supported():
        pytest.skip("the published index is read only on x86-64")
    p = Published(tmp_path)
    try:
        yield p
    finally:
        p.close()


def _reader(p: Published) -> DirectReader:
    return DirectReader(IndexReader(index_name(p.name)), p.view, "alpha")


def test_direct_device_read_lands_exact_bytes_without_a_host_hash(
    published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = [torch.randn(2, 2, 4, 64, dtype=torch.float32) for _ in range(6)]
    skeys = [published.put(secrets.token_bytes(16), v)[0] for v in values]
    reader = _reader(published)
    engine = HostCopyEngine()
    reg = HostRegistry(RecordingCudart).register(published.view.ctypes.data, published.size)
    import kvstore.client.transport.shm_direct as shm_direct

    def no_hash(data: object) -> int:
        raise AssertionError("the same-host device path hashed a block")

    monkeypatch.setattr(shm_direct, "checksum", no_hash)
    outs = [torch.zeros_like(v) for v in values]
    with DeviceRead(engine, published.view, reg) as landing:
        got = reader.read_device(skeys, outs, b"", False, NodeCounters(), landing)
    assert [r for r, _ in got] == [True] * 6
    assert engine.stats["syncs"] == 1 and engine.stats["copies"] == 6
    for v, out in zip(values, outs, strict=True):
        assert torch.equal(v, out)
    reader.close()


def test_a_block_rewritten_during_a_direct_read_is_a_fallback(published: Published) -> None:
    values = [torch.full((4, 1024), float(i), dtype=torch.float32) for i in range(3)]
    placed = [published.put(secrets.token_bytes(16), v) for v in values]
    reader = _reader(published)
    victim_key, victim_off = placed[1]

    def rewrite() -> None:  # the server frees the extent and reuses it meanwhile
        published.index.unpublish(victim_key)
        start = victim_off + HEADER_SIZE
        published.view[start : start + values[1].numel() * 4] = 0xEE
        published.index.publish(victim_key, victim_off)

    engine = RacingEngine(rewrite)
    reg = HostRegistry(RecordingCudart).register(published.view.ctypes.data, published.size)
    counters = NodeCounters()
    outs = [torch.zeros_like(v) for v in values]
    with DeviceRead(engine, published.view, reg) as landing:
        got = reader.read_device([k for k, _ in placed], outs, b"", False, counters, landing)
    assert got[0][0] is True and got[2][0] is True
    assert got[1] == (FALLBACK, 0)  # the bytes it copied are never reported as read
    assert counters.get("shm_direct_raced") == 1
    assert torch.equal(outs[0], values[0]) and torch.equal(outs[2], values[2])
    reader.close()
