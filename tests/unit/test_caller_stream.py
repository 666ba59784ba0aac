"""kvstore/copies/caller.py off a GPU: with CUDA never started in this process, nothing
is captured and a part runs as it is (no torch import, no stream). On a GPU the caller's
stream is carried: tests/gpu/test_client_cuda.py."""

from __future__ import annotations

import sys
import threading

import pytest

from kvstore.copies.caller import caller_stream, on_stream, with_caller_stream


def test_without_cuda_nothing_is_captured_and_calls_run_as_they_are() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a GPU run's earlier test
        pytest.skip("CUDA was started in this process: tests/gpu covers this case")
    assert caller_stream() is None

    def part() -> str:
        return threading.current_thread().name

    assert with_caller_stream(part) is part
    with on_stream(None):
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(with_caller_stream(part)()), name="p")
        t.start()
        t.join()
    assert out == ["p"]
