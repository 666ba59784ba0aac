"""prefix_keys: the published vectors, the spec re-derived independently, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from hashlib import blake2b
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError, InvalidKey
from kvstore.keys import Namespace, as_key, prefix_keys

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "support" / "vectors" / "prefix_keys.json").read_text()
)


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: f"{c['model']}-{c['tenant']}")
def test_published_vectors(case: dict) -> None:
    ns = Namespace(case["model"], case["layout"], case["tenant"])
    keys = prefix_keys(case["tokens"], case["block_tokens"], ns)
    assert [k.hex() for k in keys] == case["keys"]
    assert ns.fingerprint().hex() == case["namespace_fingerprint"]


def test_spec_rederived_by_hand() -> None:
    """The chain exactly as DESIGN.md writes it, with hashlib and struct only."""
    ns = Namespace("llama-3-8b", "bf16:L32:H8:D128", "acme")
    root = blake2b(b"llama-3-8b\x00bfloat16:L32:H8:D128:B16:R0\x00acme", digest_size=16)
    prev = root.digest()
    toks = list(range(100, 148))
    want = []
    for i in range(3):
        data = b"".join(t.to_bytes(4, "little") for t in toks[i * 16 : (i + 1) * 16])
        prev = blake2b(prev + data, digest_size=16).digest()
        want.append(prev)
    assert prefix_keys(toks, 16, ns) == want


def test_input_types_agree() -> None:
    ns = Namespace("m", "fp16:L2:H2:D8")
    toks = list(range(1000, 1070))
    base = prefix_keys(toks, 16, ns)
    assert len(base) == 4  # only full blocks
    assert prefix_keys(tuple(toks), 16, ns) == base
    assert prefix_keys(np.array(toks, dtype=np.int64), 16, ns) == base
    assert prefix_keys(np.array(toks, dtype=np.uint32), 16, ns) == base
    assert prefix_keys(torch.tensor(toks), 16, ns) == base
    assert prefix_keys(iter(toks), 16, ns) == base


def test_chain_continues_with_parent() -> None:
    ns = Namespace("m", "fp16:L2:H2:D8")
    toks = list(range(64))
    whole = prefix_keys(toks, 16, ns)
    head = prefix_keys(toks[:32], 16, ns)
    tail = prefix_keys(toks[32:], 16, ns, parent=head[-1])
    assert head + tail == whole


def test_namespace_separates_keys() -> None:
    toks = list(range(32))
    a = prefix_keys(toks, 16, Namespace("m", "fp16:L2:H2:D8", "a"))
    b = prefix_keys(toks, 16, Namespace("m", "fp16:L2:H2:D8", "b"))
    c = prefix_keys(toks, 16, Namespace("m", "bf16:L2:H2:D8", "a"))
    d = prefix_keys(toks, 8, Namespace("m", "fp16:L2:H2:D8", "a"))
    assert len({a[0], b[0], c[0], d[0]}) == 4


def test_prefix_property() -> None:
    ns = Namespace("m", "fp16:L2:H2:D8")
    a = prefix_keys(list(range(48)), 16, ns)
    b = prefix_keys(list(range(32)) + [7] * 16, 16, ns)
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.process
def test_deterministic_across_processes() -> None:
    code = (
        "from kvstore.keys import Namespace, prefix_keys;"
        "print(prefix_keys(list(range(64)), 16, Namespace('m','fp16:L2:H2:D8'))[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = prefix_keys(list(range(64)), 16, Namespace("m", "fp16:L2:H2:D8"))[-1].hex()
    assert out.stdout.strip() == here


@pytest.mark.parametrize(
    "tokens", [[-1] * 16, [2**32] * 16, [1.5] * 16, np.zeros((2, 16), dtype=np.int32), np.zeros(16)]
)
def test_bad_tokens_refused(tokens: object) -> None:
    with pytest.raises(InvalidKey):
        prefix_keys(tokens, 16, Namespace("m", "fp16:L2:H2:D8"))  # type: ignore[arg-type]


def test_bad_namespace_and_block_size() -> None:
    with pytest.raises(ConfigError):
        Namespace("m", "fp16:L2:H2")
    with pytest.raises(ConfigError):
        Namespace("", "fp16:L2:H2:D8")
    with pytest.raises(ConfigError):
        Namespace("m", "int3:L2:H2:D8")
    with pytest.raises(ConfigError):
        prefix_keys([1] * 16, 0, Namespace("m", "fp16:L2:H2:D8"))
    with pytest.raises(ConfigError, match="B32"):
        prefix_keys([1] * 16, 16, Namespace("m", "fp16:L2:H2:D8:B32"))


@pytest.mark.parametrize("key", [b"short", b"x" * 17, "a" * 16, 12345, None])
def test_as_key_refuses_malformed(key: object) -> None:
    with pytest.raises(InvalidKey):
        as_key(key)


def test_as_key_accepts_buffers() -> None:
    assert as_key(bytearray(16)) == bytes(16)
    assert as_key(memoryview(bytes(16))) == bytes(16)
