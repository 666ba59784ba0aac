"""kvstore/copies/caller.py off a GPU.

With CUDA never started and no inference mode, nothing is captured and a part runs as
it is. Under ``torch.inference_mode()`` (an engine's forward) a part run on a pool
thread may update the caller's inference tensors in place, as every CUDA copy into
them does (``Tensor.copy_``); torch refuses that to a thread outside inference mode.
On a GPU the caller's streams are carried too: tests/gpu/test_client_cuda.py."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.client.fanout import FanOut
from kvstore.copies.caller import as_caller, capture, with_caller


def _no_cuda() -> None:
    if torch.cuda.is_initialized():  # a GPU run's earlier test
        pytest.skip("CUDA was started in this process: tests/gpu covers this case")


def _on_thread(fn: Callable[[], Any]) -> list[Any]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # reported to the test thread
            out.append(exc)

    t = threading.Thread(target=run, name="p")
    t.start()
    t.join()
    return out


def test_without_cuda_or_inference_mode_nothing_is_captured() -> None:
    _no_cuda()
    assert "torch" in sys.modules
    assert capture() is None

    def part() -> str:
        return threading.current_thread().name

    assert with_caller(part) is part
    with as_caller(None):
        assert _on_thread(with_caller(part)) == ["p"]


def test_a_pool_thread_lands_bytes_in_the_callers_inference_tensors() -> None:
    _no_cuda()
    src = torch.arange(8, dtype=torch.uint8)
    with torch.inference_mode():
        dst = torch.zeros(8, dtype=torch.uint8)  # as a prefill allocates its prefix's KV

        def land() -> bool:
            dst[:8].copy_(src)
            return torch.is_inference_mode_enabled()

        bare = _on_thread(land)  # what a pool thread did before
        carried = _on_thread(with_caller(land))
    assert isinstance(bare[0], RuntimeError) and "inference" in str(bare[0]).lower()
    assert carried == [True]
    assert torch.equal(dst, src)


def test_fanout_parts_run_in_the_callers_inference_mode() -> None:
    _no_cuda()
    fan = FanOut(2, name="t-caller")
    try:
        parts = [torch.is_inference_mode_enabled] * 3
        assert fan.run(parts) == [False, False, False]
        with torch.inference_mode():
            assert fan.run(parts) == [True, True, True]
            assert [
                r
                for _, r in fan.each(
                    {"a": [0], "b": [1]}, lambda _: torch.is_inference_mode_enabled()
                )
            ] == [True, True]
        assert fan.run(parts) == [False, False, False]  # a pool thread keeps no mode
    finally:
        fan.close()
