"""The process's registry of host memory registered with CUDA (kvstore/copies/registry.py:
the node's DRAM slab and a client's mapping of a segment alike), against a cudart-like
object that records its calls: chunks of at most the limit, every return code checked,
never one range twice (whoever registered the first), released on the last use, a
failure that falls back (and says so once, naming the range's owner) and clears CUDA's
last error. tests/gpu/test_copies_cuda.py runs it against the real driver."""

from __future__ import annotations

import logging

import pytest

from kvstore.copies.registry import MAX_CHUNK, HostRegistry
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
    with caplog.at_level(logging.DEBUG, logger="kvstore.copies.registry"):
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


def test_a_node_slab_and_a_client_mapping_share_one_table() -> None:
    """A process that holds a node and a client registers both in one registry: the
    client's mapping is its own range, an overlap of the slab is refused before the
    driver sees it, and the slab's owner is named in the refusal."""
    rt = RecordingCudart()
    registry = HostRegistry(lambda: rt, chunk=1 << 20)
    slab = registry.register(1 << 30, 4 << 20, "the node's DRAM slab")
    mapping = registry.register(1 << 40, 4 << 20, "the client's mapping")
    assert slab.pinned and mapping.pinned and registry.live() == 2
    stray = registry.register((1 << 30) + (1 << 20), 1 << 20, "a stray view")
    assert not stray.pinned and len(rt.calls) == 8  # the driver never saw the stray
    registry.release(stray)
    registry.release(mapping)
    assert sorted(rt.registered) == [(1 << 30) + i * (1 << 20) for i in range(4)]
    registry.release(slab)
    assert not rt.registered and registry.live() == 0


class _NamingCudart(RecordingCudart):
    def cudaGetErrorString(self, err: int) -> str:
        return {2: "out of memory"}.get(err, "unknown error")


def test_a_failure_clears_the_last_error_and_names_it(caplog: pytest.LogCaptureFixture) -> None:
    rt = _NamingCudart(fail_at=1)
    cleared: list[int] = []
    registry = HostRegistry(lambda: rt, chunk=1 << 20, clear=lambda: cleared.append(1))
    with caplog.at_level(logging.WARNING, logger="kvstore.copies.registry"):
        reg = registry.register(1 << 30, 2 << 20, "the node's DRAM slab x")
    assert not reg.pinned and cleared == [1]  # once, after the failed call
    (record,) = caplog.records
    message = record.getMessage()
    assert "the node's DRAM slab x" in message and "out of memory (2)" in message
    ok = registry.register(1 << 40, 1 << 20)
    assert ok.pinned and cleared == [1]  # a success clears nothing
