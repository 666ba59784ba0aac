"""The copy-engine seam and what is built on it (kvstore/copies/), on the host engine,
which runs a batch's copy only when an event after it is waited for, as a stream would:
batches (one wait each), the staging ring (a slot reused only after its copy), ordered
copies into and out of a slab, and a departure landed in pieces and hashed as they land
(the node's) or an arrival lifted in one copy. tests/gpu/test_copies_cuda.py runs the
landing on CUDA; the callers' own logic is tested in test_device_copies.py (the client)
and test_hbm_deferred.py (the HBM tier)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.blocks import checksum
from kvstore.copies.cuda import engine_for
from kvstore.copies.engine import Staged
from kvstore.copies.host import HostCopyEngine
from kvstore.copies.landing import land_hashed, lift, pieces
from kvstore.copies.staging import StagingRing
from kvstore.errors import DeviceError

MiB = 1 << 20


def _bytes(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_host_batch_runs_copies_only_when_waited_for() -> None:
    engine = HostCopyEngine()
    batch = engine.begin("cpu")
    src = np.arange(16, dtype=np.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    batch.h2d([dst], [src])
    assert not dst.any()  # queued, not run: reading it now would be the bug
    batch.finish()
    assert bytes(dst.numpy()) == bytes(src)
    assert engine.stats == {"batches": 1, "copies": 1, "syncs": 1, "waits": 1}


def test_a_batch_left_by_an_exception_still_runs_its_copies() -> None:
    engine = HostCopyEngine()
    dst = np.zeros(8, dtype=np.uint8)
    with pytest.raises(KeyError), engine.begin("cpu") as batch:
        batch.d2h([dst], [torch.full((8,), 3, dtype=torch.uint8)])
        raise KeyError("a failure mid-batch")
    assert engine.stats["syncs"] == 1 and bytes(dst) == b"\x03" * 8
    with pytest.raises(DeviceError), engine.begin("cpu") as batch:
        batch.d2h([dst], [torch.zeros(4, dtype=torch.uint8)])  # sizes differ: refused


def test_a_ring_slot_is_reused_only_after_its_copy() -> None:
    engine = HostCopyEngine()
    batch = engine.begin("cpu")
    ring = StagingRing(engine, slots=1)
    a, b = torch.empty(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)
    ring.take(4)[:] = 1
    ring.upload(batch, a)
    view = ring.take(4)  # waits for a's copy before the buffer is refilled
    assert bytes(a.numpy()) == b"\x01" * 4
    view[:] = 2
    ring.upload(batch, b)
    batch.finish()
    ring.close()
    assert bytes(b.numpy()) == b"\x02" * 4
    with pytest.raises(RuntimeError):
        ring.upload(batch, a)  # nothing taken


def test_ordered_copies_into_and_out_of_a_slab() -> None:
    engine = engine_for("cpu")
    assert isinstance(engine, HostCopyEngine)
    slab = engine.slab(1024, "cpu")
    value = _bytes(1, 256)
    engine.write(slab[128:384], value)
    staged = engine.staging(256)
    staged.view[:] = 9
    engine.write(slab[512:768], staged.part(256), host_src=True)  # a filled staging buffer
    out = torch.zeros(256, dtype=torch.uint8)
    engine.read(out, slab[128:384])
    assert torch.equal(out, value) and int(slab[512:768].min()) == 9 == int(slab[512:768].max())
    assert engine.stats["batches"] == 0  # no batch, no host wait: the stream orders them


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 17, 16 * MiB])
@pytest.mark.parametrize("pinned", [True, False])
def test_a_landing_in_pieces_hashes_what_landed(nbytes: int, pinned: bool) -> None:
    engine = HostCopyEngine()
    src = _bytes(nbytes, nbytes)
    dst = np.zeros(nbytes, dtype=np.uint8)
    got = land_hashed(engine, src, dst, pinned=pinned)
    assert got == checksum(src.numpy()) and np.array_equal(dst, src.numpy())
    spans = pieces(nbytes)
    assert spans[0][0] == 0 and spans[-1][1] == nbytes and len(spans) <= 8
    # one batch, one copy and one wait per piece: each piece is hashed once it landed
    assert engine.stats["batches"] == 1 and engine.stats["copies"] == len(spans)
    assert engine.stats["waits"] == len(spans) and engine.stats["syncs"] == 1


class _Counting(HostCopyEngine):
    """The host engine, keeping the size of every staging buffer it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: list[int] = []

    def staging(self, n: int) -> Staged:
        self.staged.append(n)
        return super().staging(n)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_lift_is_one_copy_waited_for(pinned: bool) -> None:
    engine = _Counting()
    src = _bytes(3, MiB + 5).numpy()
    dst = torch.zeros(MiB + 5, dtype=torch.uint8)
    lift(engine, src, dst, pinned=pinned)
    assert np.array_equal(dst.numpy(), src)
    assert engine.stats == {"batches": 1, "copies": 1, "syncs": 1, "waits": 1}
    assert engine.staged == ([] if pinned else [MiB + 5])  # staged once when not page-locked
