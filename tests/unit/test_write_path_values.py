"""Values the write path must refuse with a clear kvstore error (issue 18): raw bytes
whose size is not a block of the namespace's layout, and meta tensors (no data)."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks import describe
from kvstore.errors import InvalidValue, LayoutMismatch
from kvstore.keys import Namespace, prefix_keys
from kvstore.node.store import StoreNode

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
BLOCK = 2 * 2 * 2 * 16 * 16 * 4
OPEN = Namespace("tiny", "fp32:L2:H2:D16", "t")  # block size left open
TOKEN = 2 * 2 * 2 * 16 * 4


def _key(i: int) -> bytes:
    return prefix_keys([i] * 16, 16, NS)[0]


def test_raw_bytes_must_be_one_block_of_the_layout() -> None:
    with StoreNode(node_id="v", dram_bytes=1 << 20, warm=False) as node:
        with pytest.raises(LayoutMismatch, match="holds 8192"):
            node.put(_key(1), b"x" * 100, namespace=NS)
        assert node.exists([_key(1)]) == [False]
        assert node.put(_key(2), b"x" * BLOCK, namespace=NS)
        with pytest.raises(LayoutMismatch, match="whole tokens"):
            node.put(_key(3), b"x" * (TOKEN + 1), namespace=OPEN)
        assert node.put(_key(4), bytearray(3 * TOKEN), namespace=OPEN)
        assert node.put(_key(5), b"no namespace, no layout")  # nothing to check against


def test_a_meta_tensor_is_a_clear_kvstore_error() -> None:
    t = torch.empty((2, 2, 2, 16, 16), device="meta")
    with pytest.raises(InvalidValue, match="meta tensor"):
        describe(t)
    with StoreNode(node_id="m", dram_bytes=1 << 20, warm=False) as node:
        with pytest.raises(InvalidValue, match="meta tensor"):
            node.put(_key(6), t, namespace=NS)
        assert node.put(_key(6), torch.zeros((2, 2, 2, 16, 16)), namespace=NS)
        with pytest.raises(InvalidValue, match="meta tensor"):
            node.get_into(_key(6), t)
