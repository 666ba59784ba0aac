"""The client's CUDA registration of the node's segment (kvstore/client/device/registry.py),
against a cudart-like object that records its calls: chunks of at most the limit, every
return code checked, never one range twice, released on the last use, a failure that
falls back (and says so once)."""

from __future__ import annotations

import logging

import pytest

from kvstore.client.device.registry import MAX_CHUNK, HostRegistry
from tests.support.cudart import RecordingCudart


def test_chunks_cover_the_mapping_once_and_go_on_the_last_release() -> None:
    rt = RecordingCudart()
    registry = HostRegistry(lambda: rt, chunk=1 << 20)
    base, size = 0x7F00_0000_0000, (3 << 20) + 4096
    reg = registry.register(base, size)
    assert reg.pinned
    assert [(c[1] - base, c[2]) for c in rt.calls] == [
        (0, 1 << 20),
        (1 << 20, 1 << 20),
        (2 << 20, 1 << 20),
        (3 << 20, 4096),
    ]
    again = registry.register(base, size)  # another transport of the same mapping
    assert again is reg and len(rt.calls) == 4
    registry.release(reg)
    assert rt.registered  # one use left
    registry.release(again)
    assert not rt.registered and registry.live() == 0
    assert [c[0] for c in rt.calls[4:]] == ["unregister"] * 4


def test_a_copy_is_split_where_it_crosses_a_chunk() -> None:
    registry = HostRegistry(RecordingCudart, chunk=1 << 20)
    reg = registry.register(1 << 30, 4 << 20)
    assert reg.pieces((1 << 30) + 100, 1000) == [(0, 1000)]
    at = (1 << 30) + (1 << 20) - 10
    assert reg.pieces(at, 30) == [(0, 10), (10, 30)]
    mib = 1 << 20
    assert reg.pieces(at, mib + 20) == [(0, 10), (10, mib + 10), (mib + 10, mib + 20)]


def test_an_overlapping_range_is_never_registered_twice() -> None:
    rt = RecordingCudart()
    registry = HostRegistry(lambda: rt, chunk=1 << 20)
    first = registry.register(1 << 30, 2 << 20)
    other = registry.register((1 << 30) + 4096, 1 << 20)  # overlaps: refused here
    assert first.pinned and not other.pinned
    assert len(rt.calls) == 2  # the driver never saw the second
    registry.release(other)
    assert rt.registered  # the first one's chunks stay


def test_a_failed_chunk_unregisters_the_others_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = RecordingCudart(fail_at=2)
    registry = HostRegistry(lambda: rt, chunk=1 << 20)
    with caplog.at_level(logging.DEBUG, logger="kvstore.client.device.registry"):
        reg = registry.register(1 << 30, 4 << 20)
        assert not reg.pinned and not rt.registered  # chunks 0 and 1 undone
        assert [c[0] for c in rt.calls] == ["register"] * 3 + ["unregister"] * 2
        same = registry.register(1 << 30, 4 << 20)  # never retried for this mapping
        assert same is reg and len(rt.calls) == 5
        other = registry.register(1 << 40, 1 << 20)  # another mapping is tried
        assert other.pinned
        rt.fail_at = len([c for c in rt.calls if c[0] == "register"])
        third = registry.register(1 << 41, 1 << 20)
        assert not third.pinned
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pinned staging" in warnings[0].getMessage()


def test_no_cuda_runtime_or_a_raising_binding_falls_back() -> None:
    def missing() -> RecordingCudart:
        raise RuntimeError("Found no NVIDIA driver on your system")

    assert not HostRegistry(missing).register(1 << 30, 4096).pinned
    rt = RecordingCudart(raises=True)
    reg = HostRegistry(lambda: rt).register(1 << 30, 4096)
    assert not reg.pinned and not rt.registered


def test_chunks_are_bounded_by_64_gib() -> None:
    with pytest.raises(ValueError):
        HostRegistry(RecordingCudart, chunk=MAX_CHUNK + 1)
    rt = RecordingCudart()
    reg = HostRegistry(lambda: rt).register(1 << 44, MAX_CHUNK * 2 + 1)
    assert reg.pinned and [c[2] for c in rt.calls] == [MAX_CHUNK, MAX_CHUNK, 1]
