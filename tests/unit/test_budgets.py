"""Budgets on a real StoreNode (shared-memory DRAM, lmdb SSD in tmp_path): a budgeted
namespace set is refused past its writes in flight, and past its bytes in a tier makes
room from its own least recently used blocks, never another namespace's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.blocks import HEADER_SIZE, describe
from kvstore.errors import QuotaExceeded
from kvstore.keys import Namespace, prefix_keys
from kvstore.node.budgets import Budget
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind

LAYOUT = "fp32:L1:H1:D16:B16"
A = Namespace("m", LAYOUT, "alpha")
B = Namespace("m", LAYOUT, "bravo")
VALUE = np.zeros((1, 2, 1, 16, 16), dtype=np.float32)  # 2 KiB
SIZE = HEADER_SIZE + VALUE.nbytes


def _keys(ns: Namespace, n: int) -> list[bytes]:
    return list(prefix_keys(list(range(n * 16)), 16, ns))


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    n = StoreNode(
        node_id="b1",
        dram_bytes=16 * 4096,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=64 * 8192,
        warm=False,
    )
    yield n
    n.close()


def _budget(ns: Namespace, **limits: int) -> Budget:
    tiers = {TierKind(k): v for k, v in limits.items() if k in ("dram", "ssd")}
    return Budget(
        ns.tenant,
        frozenset({ns.fingerprint()}),
        tiers,
        reservations=limits.get("reservations", 0),
        reserved_bytes=limits.get("reserved_bytes", 0),
    )


def test_writes_in_flight_past_the_budget_are_refused(node: StoreNode) -> None:
    budget = _budget(A, reservations=2)
    node.set_budget(budget)
    ka, kb = _keys(A, 4), _keys(B, 4)
    held = [node.reserve(k, describe(VALUE), namespace=A) for k in ka[:2]]
    assert node.usage(budget).reservations == 2
    with pytest.raises(QuotaExceeded, match="2 writes in flight"):
        node.reserve(ka[2], describe(VALUE), namespace=A)
    others = [node.reserve(k, describe(VALUE), namespace=B) for k in kb]  # unaffected
    for res in others:
        assert res is not None
        node.abort(res)
    res0 = held[0]
    assert res0 is not None
    res0.write(VALUE)
    assert node.commit(res0)
    res1 = held[1]
    assert res1 is not None
    node.abort(res1)
    assert node.usage(budget).reservations == 0
    assert node.usage(budget).tier_bytes[TierKind.DRAM] == SIZE
    assert node.reserve(ka[2], describe(VALUE), namespace=A) is not None  # room again


def test_reserved_bytes_are_bounded(node: StoreNode) -> None:
    node.set_budget(_budget(A, reserved_bytes=SIZE + 10))
    ka = _keys(A, 2)
    assert node.reserve(ka[0], describe(VALUE), namespace=A) is not None
    with pytest.raises(QuotaExceeded, match="bytes of writes in flight"):
        node.reserve(ka[1], describe(VALUE), namespace=A)


def test_over_its_dram_quota_a_namespace_demotes_its_own_oldest(node: StoreNode) -> None:
    budget = _budget(A, dram=4 * SIZE)
    node.set_budget(budget)
    kb = _keys(B, 10)
    for k in kb:
        node.put(k, VALUE, namespace=B)
    ka = _keys(A, 12)
    for k in ka:  # three times its quota, into a tier B fills to 60%
        node.put(k, VALUE, namespace=A)
    assert all(node.tier_of(k) is TierKind.DRAM for k in kb), "A pushed B out of DRAM"
    in_dram = [k for k in ka if node.tier_of(k) is TierKind.DRAM]
    assert in_dram == ka[-4:], "A kept other than its newest blocks"
    assert all(node.tier_of(k) is TierKind.SSD for k in ka[:-4])
    assert node.usage(budget).tier_bytes[TierKind.DRAM] == 4 * SIZE
    assert node.stats()["counters"]["quota_evictions_dram"] == 8


def test_a_read_refreshes_a_block_within_its_namespace(node: StoreNode) -> None:
    node.set_budget(_budget(A, dram=3 * SIZE))
    ka = _keys(A, 4)
    for k in ka[:3]:
        node.put(k, VALUE, namespace=A)
    assert node.get(ka[0], namespace=A) is not None  # now the most recent
    node.put(ka[3], VALUE, namespace=A)
    assert node.tier_of(ka[1]) is TierKind.SSD
    assert node.tier_of(ka[0]) is TierKind.DRAM


def test_with_its_own_blocks_pinned_the_write_is_refused(node: StoreNode) -> None:
    node.set_budget(_budget(A, dram=2 * SIZE))
    ka = _keys(A, 3)
    for k in ka[:2]:
        node.put(k, VALUE, namespace=A)
    reads = [node.open_read(k, namespace=A) for k in ka[:2]]
    with pytest.raises(QuotaExceeded, match="dram quota"):
        node.put(ka[2], VALUE, namespace=A)
    for r in reads:
        assert r is not None
        node.close_read(r)
    assert node.put(ka[2], VALUE, namespace=A)


def test_over_its_ssd_quota_its_own_oldest_leave_the_node(node: StoreNode) -> None:
    budget = _budget(A, dram=2 * SIZE, ssd=3 * SIZE)
    node.set_budget(budget)
    kb = _keys(B, 4)
    for k in kb:
        node.put(k, VALUE, namespace=B)
    node.evict(TierKind.DRAM, 0)  # B's blocks now on SSD
    ka = _keys(A, 10)
    for k in ka:
        node.put(k, VALUE, namespace=A)
    assert all(node.tier_of(k) is TierKind.SSD for k in kb), "A pushed B off the SSD"
    usage = node.usage(budget)
    assert usage.tier_bytes[TierKind.SSD] <= 3 * SIZE
    assert sum(node.exists(ka)) == 5  # 2 in DRAM, 3 on SSD: its oldest left
    assert node.exists(ka[-5:]) == [True] * 5


def test_a_budget_replaced_by_name_covers_new_namespaces(node: StoreNode) -> None:
    other = Namespace("m2", LAYOUT, "alpha")
    node.set_budget(_budget(A, reservations=1))
    assert node.reserve(_keys(A, 1)[0], describe(VALUE), namespace=A) is not None
    assert node.reserve(_keys(other, 1)[0], describe(VALUE), namespace=other) is not None
    both = Budget("alpha", frozenset({A.fingerprint(), other.fingerprint()}), reservations=1)
    node.set_budget(both)
    with pytest.raises(QuotaExceeded):
        node.reserve(_keys(other, 2)[1], describe(VALUE), namespace=other)
    assert node.usage(both).reservations == 2
