"""The shared copy machinery (kvstore/copies/) on a CUDA device: the process's registry
against the real driver (never one range twice, no late error left behind), and the
landing and lifting of bytes through the CUDA engine, exact, straight from registered
memory and through pinned staging. tests/unit/test_copies_registry.py and
tests/unit/test_copies_engine.py run the same logic on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.blocks import checksum
from kvstore.copies.cuda import CudaCopyEngine, engine_for, process_engine
from kvstore.copies.landing import land_hashed, lift
from kvstore.copies.registry import process_registry

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

MiB = 1 << 20


def test_a_range_is_never_registered_twice() -> None:
    registry = process_registry()
    before = registry.live()
    buf = np.zeros(8 * MiB, dtype=np.uint8)
    ptr = buf.ctypes.data
    first = registry.register(ptr, buf.nbytes, "test buffer")
    again = registry.register(ptr, buf.nbytes, "test buffer")  # the same range: shared
    overlap = registry.register(ptr + MiB, MiB, "an overlap")  # refused before CUDA sees it
    try:
        assert first.pinned and again is first and not overlap.pinned
        assert (torch.ones(4, device="cuda") + 1).sum().item() == 8  # no late error
    finally:
        registry.release(overlap)
        registry.release(again)
        registry.release(first)
    assert registry.live() == before


@pytest.mark.parametrize("registered", [True, False])
def test_land_hashed_and_lift_are_exact_on_cuda(registered: bool) -> None:
    engine = engine_for("cuda")
    assert isinstance(engine, CudaCopyEngine) and engine is process_engine()
    n = 3 * MiB + 17
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    host = np.zeros(n, dtype=np.uint8)
    reg = process_registry().register(host.ctypes.data, n, "test landing") if registered else None
    try:
        pinned = reg is not None and reg.pinned
        assert pinned is registered
        got = land_hashed(engine, src, host, pinned=pinned)
        assert got == checksum(src.cpu().numpy()) and np.array_equal(host, src.cpu().numpy())
        back = torch.zeros_like(src)
        lift(engine, host, back, pinned=pinned)
        assert torch.equal(back, src)
    finally:
        if reg is not None:
            process_registry().release(reg)


def test_a_pool_thread_runs_as_its_caller_on_the_device() -> None:
    """kvstore/copies/caller.py on CUDA: a part run on another thread copies into the
    caller's inference tensors in place (torch refuses that to a thread outside
    inference mode), on the caller's current stream and device, and its exit makes no
    other device current (which would create a context there)."""
    import threading

    from kvstore.copies.caller import with_caller

    side = torch.cuda.Stream()
    src = torch.arange(64, dtype=torch.float32, device="cuda")
    seen: list[object] = []

    def part() -> None:
        dst[:64].copy_(src, non_blocking=True)  # a plain slice: an inference tensor
        seen.extend([torch.cuda.current_stream(), torch.cuda.current_device()])

    def on_thread(fn: object) -> list[BaseException]:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                fn()  # type: ignore[operator]
            except RuntimeError as exc:
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return errors

    with torch.inference_mode(), torch.cuda.stream(side):
        dst = torch.zeros(128, dtype=torch.float32, device="cuda")
        assert on_thread(part) and not seen  # bare: refused
        assert on_thread(with_caller(part)) == []
        side.synchronize()
    assert seen == [side, torch.cuda.current_device()]
    assert torch.equal(dst[:64].cpu(), src.cpu()) and not dst[64:].any()
