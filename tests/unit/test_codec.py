"""KV codecs: round-trip error bounds per codec and dtype, edge cases, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstore.codec import codec_names, get_codec, normalize_codec
from kvstore.codec.format import encoded_nbytes
from kvstore.errors import ConfigError, CorruptBlock, InvalidValue, LayoutMismatch

SHAPE = (3, 2, 4, 16, 32)  # layers, k|v, kv heads, tokens, head dim
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Worst error over a head's absmax: half the grid step at the top of the range (int8:
# 0.5/127; e4m3: spacing 32 between 256 and 448, so 16/448), plus the output dtype's
# rounding of the decoded value (at most half an ulp of absmax).
CODEC_BOUND = {"int8": 0.5 / 127, "fp8": 16 / 448}
OUT_ROUNDING = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}


def _block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random KV with heads of very different ranges (1e-3 .. 1e3): per-head scales
    must keep the small heads as accurate as the large ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    ranges = torch.logspace(-3, 3, SHAPE[2]).view(1, 1, -1, 1, 1)
    return (x * ranges).to(dtype)


def _roundtrip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(name)
    data = codec.encode(x)
    out = torch.full_like(x, float("nan"))
    assert codec.decode(data, out) is out
    return data, out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_roundtrip_error_within_bound_per_head(name: str, dtype: torch.dtype) -> None:
    x = _block(dtype)
    data, y = _roundtrip(name, x)
    assert data.dtype == torch.uint8 and data.numel() == encoded_nbytes(SHAPE)
    assert data.numel() < x.numel() * x.element_size() or dtype == torch.float16
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    amax = xf.abs().amax(dim=(3, 4), keepdim=True)
    err = (yf - xf).abs() / amax
    bound = CODEC_BOUND[name] + OUT_ROUNDING[dtype]
    assert float(err.max()) <= bound * 1.001
    assert float(err.mean()) < bound / 2  # not just bounded: most elements land closer


def test_fp8_keeps_relative_error_int8_keeps_absolute() -> None:
    """e4m3's error scales with each element; int8's is one grid step wherever it is."""
    x = _block(torch.float32)
    head = x[0, 0, 1]
    small = (head.abs() > head.abs().max() / 64) & (head.abs() < head.abs().max() / 8)
    rel = {}
    for name in ("fp8", "int8"):
        y = _roundtrip(name, x)[1][0, 0, 1]
        rel[name] = float(((y - head).abs() / head.abs())[small].max())
    assert rel["fp8"] <= 2**-4 * 1.001 < rel["int8"]


def test_fp8_decodes_every_code_as_torch_does() -> None:
    """Decode's table agrees with torch's own float8_e4m3fn conversion on all 254
    codes encode can write (0x7f and 0xff are NaN, never written)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    shape = (1, 2, 1, 1, 127)  # two scales (1.0), 254 values
    data = torch.cat([torch.ones(2).view(torch.uint8), codes])
    out = get_codec("fp8").decode(data, torch.empty(shape))
    assert torch.equal(out.view(-1), codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_zero_heads_decode_to_exact_zeros(name: str) -> None:
    x = _block(torch.bfloat16)
    x[1, 0, 2] = 0  # one all-zero head: scale 0
    x[2] = 0  # a whole layer
    y = _roundtrip(name, x)[1]
    assert torch.equal(y[1, 0, 2], torch.zeros_like(y[1, 0, 2]))
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert not torch.isnan(y).any()
    zeros = torch.zeros(SHAPE, dtype=torch.float16)
    assert torch.equal(_roundtrip(name, zeros)[1], zeros)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_exact_values_survive(name: str) -> None:
    """The head's absmax and zero come back exactly (the scale maps absmax to qmax)."""
    x = _block(torch.float32)
    y = _roundtrip(name, x)[1]
    i = x.abs().flatten(3).argmax(dim=3)
    top = torch.gather(x.flatten(3), 3, i.unsqueeze(3))
    back = torch.gather(y.flatten(3), 3, i.unsqueeze(3))
    torch.testing.assert_close(back, top, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_inf_or_nan_is_refused_with_where(name: str, bad: float) -> None:
    x = _block(torch.bfloat16)
    x[2, 1, 3, 5, 7] = bad
    with pytest.raises(InvalidValue, match=r"inf or nan at layer 2, v, head 3"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_extreme_magnitudes(name: str) -> None:
    """fp32's largest values and its subnormals neither overflow nor turn into nan."""
    x = torch.zeros(SHAPE)
    x[0, 0, 0] = torch.finfo(torch.float32).max
    x[0, 0, 0, 0, 0] = -torch.finfo(torch.float32).max
    x[0, 1, 0, 0, 1] = 1e-44  # a subnormal head: its scale underflows to 0
    y = _roundtrip(name, x)[1]
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0, 0, 0], x[0, 0, 0])
    assert float(y[0, 1, 0].abs().max()) <= 1e-44


def test_encoding_is_deterministic() -> None:
    x = _block(torch.bfloat16, seed=3)
    for name in ("fp8", "int8"):
        codec = get_codec(name)
        assert torch.equal(codec.encode(x), codec.encode(x.clone()))


def test_non_contiguous_input_and_output() -> None:
    x = _block(torch.float32).transpose(3, 4).contiguous().transpose(3, 4)
    assert not x.is_contiguous()
    codec = get_codec("int8")
    data = codec.encode(x)
    assert torch.equal(data, codec.encode(x.contiguous()))
    out = torch.empty((*SHAPE[:3], SHAPE[4], SHAPE[3])).transpose(3, 4)
    codec.decode(data, out)
    torch.testing.assert_close(out, codec.decode(data, torch.empty(SHAPE)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_prefix_decodes_straight_into_a_cache_layout(name: str, dtype: torch.dtype) -> None:
    """Blocks that are views of a KV cache's [layers, 2, heads, tokens, dim] storage (the
    adapter's compressed read) decode in place to the very values a contiguous stack
    gets, so the cache needs no second copy."""
    codec = get_codec(name)
    n, (layers, _, heads, bt, dim) = 5, SHAPE
    stack = torch.stack([torch.randn(SHAPE) * (i + 1) for i in range(n)]).to(dtype)
    data = codec.encode(stack)
    want = codec.decode(data, torch.empty(n, *SHAPE, dtype=dtype))
    cache = torch.full((layers, 2, heads, n * bt, dim), float("nan"), dtype=dtype)
    view = cache.view(layers, 2, heads, n, bt, dim).permute(3, 0, 1, 2, 4, 5)
    assert not view.is_contiguous()
    codec.decode(data, view)
    assert torch.equal(view, want)
    assert not cache.isnan().any()  # every element written
    for li in range(layers):  # or one layer at a time, into that layer's own tensor
        own = torch.empty((2, heads, n * bt, dim), dtype=dtype)
        blocks = own.view(2, heads, n, bt, dim).permute(2, 0, 1, 3, 4).unsqueeze(1)
        codec.decode(data, blocks, layers=(li, li + 1))
        assert torch.equal(blocks, want[:, li : li + 1])
    two = codec.decode(data, torch.empty(n, 2, *SHAPE[1:], dtype=dtype), layers=(0, 2))
    assert torch.equal(two, want[:, :2])
    for bad in ((0, layers + 1), (1, 1), (1, 3)):  # past the blocks, empty, or not out's
        with pytest.raises(LayoutMismatch):
            codec.decode(data, torch.empty(n, 1, *SHAPE[1:], dtype=dtype), layers=bad)


@pytest.mark.parametrize("shape", [SHAPE, (2, 2, 1, 1, 127)], ids=["aligned", "odd-size"])
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_stack_of_blocks_is_its_blocks_back_to_back(name: str, shape: tuple) -> None:
    """A prefix decodes in one call: the same bytes and values as block by block,
    also when a block's size is not a multiple of 4 (its scales then sit unaligned)."""
    codec = get_codec(name)
    stack = torch.stack([torch.randn(shape) * (i + 1) for i in range(6)]).view(2, 3, *shape)
    data = codec.encode(stack)
    per = encoded_nbytes(shape)
    assert data.shape == (2, 3, per)
    singles = [codec.encode(b) for b in stack.view(6, *shape)]
    assert torch.equal(data.view(6, per), torch.stack(singles))
    out = codec.decode(data, torch.empty(2, 3, *shape, dtype=torch.bfloat16))
    for i, one in enumerate(singles):
        want = codec.decode(one, torch.empty(shape, dtype=torch.bfloat16))
        assert torch.equal(out.view(6, *shape)[i], want)
    bad = stack.clone()
    bad[1, 2, 0, 1, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidValue, match=r"KV block 5 has inf or nan at layer 0, v, head 0"):
        codec.encode(bad)


def test_decode_takes_bytes_and_unaligned_buffers() -> None:
    x = _block(torch.float16)
    codec = get_codec("fp8")
    data = codec.encode(x)
    want = codec.decode(data, torch.empty_like(x))
    assert torch.equal(codec.decode(bytes(data.numpy()), torch.empty_like(x)), want)
    shifted = torch.empty(data.numel() + 1, dtype=torch.uint8)
    shifted[1:] = data
    assert torch.equal(codec.decode(shifted[1:], torch.empty_like(x)), want)


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (torch.zeros(SHAPE, dtype=torch.int8), "int8; a KV codec works on"),
        (torch.zeros(SHAPE, dtype=torch.float64), "float64; a KV codec works on"),
        (torch.zeros(SHAPE[1:]), "a KV block is"),
        (torch.zeros((3, 3, 4, 16, 32)), "a KV block is"),
    ],
    ids=["int8", "float64", "4d", "not-k-v"],
)
def test_bad_blocks_are_refused(block: torch.Tensor, match: str) -> None:
    with pytest.raises(InvalidValue, match=match):
        get_codec("int8").encode(block)
    with pytest.raises(InvalidValue, match=match):
        get_codec("fp8").decode(torch.zeros(10, dtype=torch.uint8), block)


def test_wrong_size_or_bad_scales_are_refused_on_decode() -> None:
    codec = get_codec("int8")
    x = _block(torch.float32)
    data = codec.encode(x)
    with pytest.raises(LayoutMismatch, match="bytes to decode"):
        codec.decode(data[:-1], torch.empty_like(x))
    with pytest.raises(LayoutMismatch, match="bytes to decode"):
        codec.decode(data, torch.empty((3, 2, 4, 8, 32)))
    for bad in (-1.0, float("nan"), float("inf")):
        forged = data.clone()
        forged[:4].view(torch.float32)[0] = bad
        with pytest.raises(CorruptBlock, match="scale"):
            codec.decode(forged, torch.empty_like(x))


def test_registry_names() -> None:
    assert codec_names() == ["fp8", "int8"]
    assert normalize_codec("FP8_E4M3") == "fp8"
    assert normalize_codec("Int8") == "int8"
    assert normalize_codec(None) is None and normalize_codec("none") is None
    assert get_codec("e4m3").name == "fp8"
    with pytest.raises(ConfigError, match="unknown KV codec 'int4'; known: fp8, int8"):
        get_codec("int4")


@pytest.mark.process
def test_layouts_parse_without_torch() -> None:
    """The server parses compressed layouts; that must not pull torch in."""
    code = (
        "import sys; from kvstore.layout import KVLayout;"
        "assert KVLayout.parse('bf16:L2:H2:D8:B16:Cint8').block_bytes() == 8*4 + 1024;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("piece", [1 << 20, 4096, 700, 1], ids=["default", "blocks", "rows", "row"])
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_decoding_in_pieces_is_exact(
    name: str, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode converts and scales a piece at a time (kvstore/codec/base.py): pieces of
    several blocks, of some rows of one block, or of one row give exactly the values
    of torch's own float8 / int8 conversion times each head's scale."""
    import kvstore.codec.base as base

    monkeypatch.setattr(base, "DECODE_PIECE", piece)
    codec = get_codec(name)
    stack = torch.stack([_block(torch.float32, seed=i) for i in range(5)])
    data = codec.encode(stack)
    out = codec.decode(data, torch.empty_like(stack))
    per = encoded_nbytes(SHAPE)
    rows = SHAPE[0] * SHAPE[1] * SHAPE[2]
    raw = data.view(5, per)
    scales = raw[:, : rows * 4].contiguous().view(torch.float32).view(5, rows, 1)
    kind = torch.float8_e4m3fn if name == "fp8" else torch.int8
    values = raw[:, rows * 4 :].contiguous().view(kind).float().view(5, rows, -1)
    assert torch.equal(out.view(5, rows, -1), values * scales)
