"""Block codec: header roundtrip, corruption detection, one-copy decode into buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.blocks import (
    HEADER_SIZE,
    KIND_BYTES,
    KIND_NUMPY,
    KIND_TORCH,
    BlockHeader,
    copy_payload,
    describe,
    host_bytes,
    materialize,
    verify_payload,
)
from kvstore.errors import CorruptBlock, InvalidValue, LayoutMismatch
from kvstore.layout import KVLayout

KEY = bytes(range(16))
NS = bytes(range(16, 32))


def _roundtrip(value: object) -> tuple[BlockHeader, bytes]:
    info = describe(value)
    payload = bytes(host_bytes(value))
    h = BlockHeader.for_value(KEY, info, payload, NS)
    packed = h.pack()
    assert len(packed) == HEADER_SIZE
    back = BlockHeader.unpack(packed)
    assert back == h
    verify_payload(back, payload)
    return back, payload


def test_torch_bf16_roundtrip() -> None:
    t = torch.randn(2, 2, 4, 16, 8).to(torch.bfloat16)
    h, payload = _roundtrip(t)
    assert h.kind == KIND_TORCH and h.dtype == "bfloat16" and h.shape == (2, 2, 4, 16, 8)
    out = materialize(h, payload)
    assert out.dtype == torch.bfloat16 and torch.equal(out, t)
    buf = torch.empty_like(t)
    copy_payload(h, np.frombuffer(payload, np.uint8), buf)
    assert torch.equal(buf, t)


def test_numpy_and_bytes_roundtrip() -> None:
    a = np.random.default_rng(0).standard_normal((2, 2, 3, 4, 5)).astype(np.float16)
    h, payload = _roundtrip(a)
    assert h.kind == KIND_NUMPY
    np.testing.assert_array_equal(materialize(h, payload), a)
    h2, p2 = _roundtrip(b"hello world")
    assert h2.kind == KIND_BYTES and materialize(h2, p2) == b"hello world"


def test_corruption_detected() -> None:
    t = torch.arange(64, dtype=torch.float32)
    h, payload = _roundtrip(t)
    bad = bytearray(payload)
    bad[5] ^= 1
    with pytest.raises(CorruptBlock):
        verify_payload(h, bad)
    with pytest.raises(CorruptBlock):
        verify_payload(h, payload[:-4])
    packed = bytearray(h.pack())
    packed[20] ^= 0xFF
    with pytest.raises(CorruptBlock, match="header"):
        BlockHeader.unpack(packed)
    with pytest.raises(CorruptBlock):
        BlockHeader.unpack(b"\x00" * 10)
    with pytest.raises(CorruptBlock):
        BlockHeader.unpack(b"\x00" * HEADER_SIZE)


def test_copy_into_wrong_output_refused() -> None:
    t = torch.arange(64, dtype=torch.float32)
    h, payload = _roundtrip(t)
    src = np.frombuffer(payload, np.uint8)
    with pytest.raises(LayoutMismatch):
        copy_payload(h, src, torch.empty(64, dtype=torch.float16))
    with pytest.raises(LayoutMismatch):
        copy_payload(h, src, torch.empty(65, dtype=torch.float32))
    ro = np.zeros(64, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidValue):
        copy_payload(h, src, ro)
    flat = np.empty(64, np.float32)  # another shape with the same bytes is fine
    copy_payload(h, src, flat)
    np.testing.assert_array_equal(flat, t.numpy())


def test_describe_refuses_bad_values() -> None:
    with pytest.raises(InvalidValue):
        describe(torch.zeros(4, 4).t())
    with pytest.raises(InvalidValue):
        describe(np.zeros(4, dtype=np.complex64))
    with pytest.raises(InvalidValue):
        describe(b"")
    with pytest.raises(InvalidValue):
        describe("a string")
    with pytest.raises(InvalidValue):
        describe(np.zeros((1,) * 7))


def test_layout_check() -> None:
    layout = KVLayout.parse("bf16:L2:H4:D8:B16")
    ok = describe(torch.zeros(2, 2, 4, 16, 8, dtype=torch.bfloat16))
    ok.check_layout(layout)
    with pytest.raises(LayoutMismatch, match="dtype"):
        describe(torch.zeros(2, 2, 4, 16, 8)).check_layout(layout)
    with pytest.raises(LayoutMismatch, match="shape"):
        describe(torch.zeros(2, 2, 4, 8, 8, dtype=torch.bfloat16)).check_layout(layout)
    # without B in the layout, any block length passes the shape check
    describe(torch.zeros(2, 2, 4, 8, 8, dtype=torch.bfloat16)).check_layout(
        KVLayout.parse("bf16:L2:H4:D8")
    )
    assert layout.block_bytes() == 2 * 2 * 4 * 16 * 8 * 2
