"""The codec in the layout: compressed and uncompressed blocks never share keys, a
fingerprint or a byte size, and uncompressed layouts hash exactly as before."""

from __future__ import annotations

from hashlib import blake2b

import pytest
import torch

from kvstore.codec import get_codec
from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.keys import Namespace, prefix_keys
from kvstore.layout import KVLayout
from kvstore.node.store import StoreNode

RAW = "bf16:L2:H2:D8:B16"
TOKENS = list(range(100, 164))
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def test_uncompressed_spelling_and_root_unchanged() -> None:
    """Re-derived by hand: the chain root of an uncompressed layout has no codec in it."""
    assert KVLayout.parse(RAW).canonical() == "bfloat16:L2:H2:D8:B16:R0"
    ns = Namespace("m", RAW, "t")
    root = blake2b(b"m\x00bfloat16:L2:H2:D8:B16:R0\x00t", digest_size=16).digest()
    first = blake2b(root + b"".join(t.to_bytes(4, "little") for t in TOKENS[:16]), digest_size=16)
    assert prefix_keys(TOKENS, 16, ns)[0] == first.digest()


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_codec_joins_the_canonical_spelling(codec: str) -> None:
    for text in (f"{RAW}:C{codec}", f"bf16:C{codec.upper()}:L2:H2:D8:B16", f"{RAW}:R0:c{codec}"):
        layout = KVLayout.parse(text)
        assert layout.codec == codec
        assert layout.canonical() == f"bfloat16:L2:H2:D8:B16:R0:C{codec}"
    assert KVLayout.parse(f"{RAW}:Cfp8_e4m3").codec == "fp8"


def test_fingerprints_and_keys_are_separate() -> None:
    spaces = [Namespace("m", RAW + c) for c in ("", ":Cfp8", ":Cint8")]
    assert len({ns.fingerprint() for ns in spaces}) == 3
    assert len({tuple(prefix_keys(TOKENS, 16, ns)) for ns in spaces}) == 3
    assert Namespace("m", RAW + ":Cint8").kv_layout == KVLayout.parse(RAW).with_codec("int8")
    assert KVLayout.parse(RAW + ":Cint8").with_codec(None) == KVLayout.parse(RAW)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_block_bytes_is_the_codec_size(codec: str, dtype: str) -> None:
    layout = KVLayout.parse(f"{dtype}:L3:H4:D32:B16:C{codec}")
    x = torch.randn(layout.block_shape()).to(TORCH_DTYPES[dtype])
    assert get_codec(codec).encode(x).numel() == layout.block_bytes()
    assert layout.raw_block_bytes() == x.numel() * x.element_size()
    assert layout.block_bytes() == 3 * 2 * 4 * (4 + 16 * 32)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("bf16:L2:H2:D8:Cint8", "a compressed layout needs B<n>"),
        ("int8:L2:H2:D8:B16:Cint8", "compresses bfloat16, float16, float32, not int8"),
        ("bf16:L2:H2:D8:B16:Cint4", "unknown KV codec 'int4'"),
        ("bf16:L2:H2:D8:B16:Cnone", "leave C out for an uncompressed layout"),
        ("bf16:L2:H2:D8:B16:Cint8:Cfp8", "field C given twice"),
        ("bf16:L2:H2:D8:B16:C8", "bad field 'C8'"),
    ],
)
def test_bad_codec_fields(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVLayout.parse(text)


def test_with_codec_checks_too() -> None:
    with pytest.raises(ConfigError, match="needs B<n>"):
        KVLayout.parse("bf16:L2:H2:D8").with_codec("fp8")
    assert KVLayout.parse("bf16:L2:H2:D8:Cint8:B16").with_block_tokens(16).codec == "int8"


def test_store_takes_only_the_codec_size_under_a_compressed_namespace() -> None:
    """A real StoreNode checks puts against the layout's compressed size, and a
    compressed block's bytes are what it keeps and hands back."""
    ns = Namespace("m", RAW + ":Cint8")
    codec = get_codec("int8")
    x = torch.randn(ns.kv_layout.block_shape()).to(torch.bfloat16)
    data = codec.encode(x)
    key = prefix_keys(TOKENS, 16, ns)[0]
    with StoreNode(node_id="u", dram_bytes=1 << 20) as node:
        with pytest.raises(LayoutMismatch, match="holds"):
            node.put(key, bytes(data.numpy()[:-1]), namespace=ns)
        with pytest.raises(LayoutMismatch, match="compressed"):  # an uncompressed tensor
            node.put(key, x, namespace=ns)
        assert node.put(key, data.numpy().data, namespace=ns)
        assert node.get(key, namespace=ns) == bytes(data.numpy())
        raw_ns = Namespace("m", RAW)
        assert not node.get_into(key, torch.empty_like(x), namespace=raw_ns)  # other fp
        landed = torch.empty(ns.kv_layout.block_bytes(), dtype=torch.uint8)
        assert node.get_into(key, landed, namespace=ns)
        y = codec.decode(landed, torch.empty_like(x))
        assert float((y.float() - x.float()).abs().max()) < 0.05 * float(x.float().abs().max())
