"""Credits (StoreNode.reserve_credit / bind): space reserved before its block's key is
known, so a same-host writer can fill it and commit it in one request. A credit is a
reservation like any other until it is bound: counted, freed by an abort, and never
visible; bound, it is the block's reservation."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.blocks import describe
from kvstore.errors import InvalidValue, LayoutMismatch, ReservationError
from kvstore.keys import Namespace, prefix_keys
from kvstore.node.store import StoreNode

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)  # 8 KiB of fp32 per block
BLOCK = 2 * 2 * 2 * 16 * 16 * 4


@pytest.fixture
def node() -> Iterator[StoreNode]:
    n = StoreNode(node_id="n1", dram_bytes=8 * (BLOCK + 256))
    yield n
    n.close()


def _key(i: int) -> bytes:
    return list(prefix_keys(list(range(16 * (i + 1))), 16, NS))[i]


def _value(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SHAPE).astype(np.float32)


def _used(node: StoreNode) -> int:
    return int(node.stats()["tiers"]["dram"]["used"])


def test_a_bound_credit_is_the_block(node: StoreNode) -> None:
    credit = node.reserve_credit(BLOCK, namespace=NS)
    assert _used(node) > 0 and node.stats()["blocks"] == 0
    value = _value(1)
    credit.payload[:] = value.view(np.uint8).reshape(-1)  # filled before it has a key
    res = node.bind(credit, _key(1), describe(value), namespace=NS)
    assert node.commit(res) is True
    assert np.array_equal(node.get(_key(1), namespace=NS), value)


def test_an_aborted_credit_frees_its_space(node: StoreNode) -> None:
    before = _used(node)
    credit = node.reserve_credit(BLOCK, namespace=NS)
    node.abort(credit)
    assert _used(node) == before
    node.abort(credit)  # twice is harmless


@pytest.mark.parametrize("what", ["size", "namespace", "layout"])
def test_a_block_that_does_not_fit_its_credit_is_refused(node: StoreNode, what: str) -> None:
    """Another size, another namespace, a value off the layout: refused; the credit is
    untouched and its abort frees the space."""
    before = _used(node)
    credit = node.reserve_credit(BLOCK, namespace=NS)
    value = _value(2)
    if what == "size":
        with pytest.raises(InvalidValue):
            node.bind(credit, _key(2), describe(value[:1]), namespace=NS)
    elif what == "namespace":
        other = Namespace("other", "fp32:L2:H2:D16:B16", "t")
        with pytest.raises(InvalidValue):
            node.bind(credit, _key(2), describe(value), namespace=other)
    else:
        wrong = value.reshape(2, 2, 2, 8, 32)
        with pytest.raises(LayoutMismatch):
            node.bind(credit, _key(2), describe(wrong), namespace=NS)
    node.abort(credit)
    assert _used(node) == before
    assert node.get(_key(2), namespace=NS) is None


def test_a_credit_binds_once(node: StoreNode) -> None:
    credit = node.reserve_credit(BLOCK, namespace=NS)
    value = _value(3)
    credit.payload[:] = value.view(np.uint8).reshape(-1)
    res = node.bind(credit, _key(3), describe(value), namespace=NS)
    with pytest.raises(ReservationError):
        node.bind(credit, _key(4), describe(value), namespace=NS)
    node.abort(credit)  # bound: an abort of the credit no longer frees anything
    assert node.commit(res) is True
    assert np.array_equal(node.get(_key(3), namespace=NS), value)


def test_a_credit_bound_to_a_stored_key_stores_nothing_twice(node: StoreNode) -> None:
    value = _value(5)
    assert node.put(_key(5), value, namespace=NS) is True
    used = _used(node)
    credit = node.reserve_credit(BLOCK, namespace=NS)
    credit.payload[:] = value.view(np.uint8).reshape(-1)
    res = node.bind(credit, _key(5), describe(value), namespace=NS)
    assert node.commit(res) is False  # keys name content: the first copy stays
    assert _used(node) == used and node.stats()["blocks"] == 1


def test_credits_make_room_like_reservations(node: StoreNode) -> None:
    """A full tier evicts to grant a credit, as it does for a put."""
    for i in range(8):
        node.put(_key(10 + i), _value(10 + i), namespace=NS)
    credits = [node.reserve_credit(BLOCK, namespace=NS) for _ in range(3)]
    assert node.stats()["blocks"] <= 5
    for c in credits:
        node.abort(c)
