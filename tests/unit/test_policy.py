"""Eviction policies: order, skip predicate, scan resistance, and the registry."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.tiers.policy import POLICIES, make_policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_evicts_everything_once(name: str) -> None:
    p = make_policy(name, 10)
    for k in range(10):
        p.insert(k, 1)
    p.touch(3)
    seen = []
    while (v := p.pop_victim()) is not None:
        seen.append(v)
    assert sorted(seen) == list(range(10)) and len(p) == 0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_skip_is_respected(name: str) -> None:
    p = make_policy(name, 4)
    for k in range(4):
        p.insert(k, 1)
    pinned = {0, 1, 2, 3}
    assert p.pop_victim(lambda k: k in pinned) is None
    assert len(p) == 4
    pinned.discard(2)
    assert p.pop_victim(lambda k: k in pinned) == 2


def test_lru_order() -> None:
    p = make_policy("lru", 3)
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    assert list(p) == ["b", "c", "a"]
    assert p.pop_victim() == "b"
    p.remove("c")
    assert list(p) == ["a"]


def test_fifo_ignores_hits() -> None:
    p = make_policy("fifo", 3)
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    assert p.pop_victim() == "a"


def _hit_rate(name: str, trace: list[int], cap: int) -> float:
    p = make_policy(name, cap)
    hits = 0
    for k in trace:
        if k in p:
            hits += 1
            p.touch(k)
            continue
        while len(p) >= cap:
            p.pop_victim()
        p.insert(k, 1)
    return hits / len(trace)


def test_s3fifo_resists_a_scan() -> None:
    """A hot set read in rounds, broken by one-off scans: S3-FIFO keeps the hot set."""
    trace: list[int] = []
    scan = 10_000
    for _ in range(30):
        trace += list(range(50)) * 2
        trace += list(range(scan, scan + 80))
        scan += 80
    lru = _hit_rate("lru", trace, 100)
    s3 = _hit_rate("s3fifo", trace, 100)
    assert s3 > lru + 0.1, (lru, s3)


def test_s3fifo_ghost_readmits_to_main() -> None:
    p = make_policy("s3fifo", 10)
    for k in range(10):
        p.insert(k, 1)
    v = p.pop_victim()
    assert v == 0  # small queue, never read
    p.insert(0, 1)  # back soon: goes to main via the ghost
    for k in range(10, 20):
        p.insert(k, 1)
        p.pop_victim()
    assert 0 in p


def test_unknown_policy() -> None:
    with pytest.raises(ConfigError, match="choose one of"):
        make_policy("mru", 10)
    with pytest.raises(ConfigError):
        make_policy("lru", 0)


def test_config_names_every_registered_policy() -> None:
    from kvstore.config import POLICY_NAMES

    assert sorted(POLICY_NAMES) == sorted(POLICIES)
