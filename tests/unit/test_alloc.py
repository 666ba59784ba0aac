"""Extent allocator: waste bound for uniform sizes, mixed sizes, coalescing."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import ConfigError
from kvstore.tiers.alloc import ExtentAllocator


@pytest.mark.parametrize("block", [64 * 1024 + 128, (1 << 20) + 128, (4 << 20) + 128])
def test_uniform_sizes_waste_under_5_percent(block: int) -> None:
    cap = 64 << 20
    a = ExtentAllocator(cap)
    offs = []
    while (o := a.alloc(block)) is not None:
        offs.append(o)
    stored = len(offs) * block
    assert a.largest_free() < block  # the slab is full: only a tail smaller than a block
    assert stored / a.used > 0.95  # alignment rounding wastes under 5%
    assert stored / (cap - cap % block) > 0.95
    # churn: free half at random, refill; still no loss
    rng = random.Random(1)
    rng.shuffle(offs)
    for o in offs[: len(offs) // 2]:
        a.free(o)
    refill = 0
    while a.alloc(block) is not None:
        refill += 1
    assert refill == len(offs) // 2


def test_mixed_sizes_and_coalescing() -> None:
    a = ExtentAllocator(1 << 20, align=256)
    rng = random.Random(7)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.randint(1, 40_000)
            off = a.alloc(n)
            if off is not None:
                for o, s in live.items():  # no overlap with any live extent
                    assert off + a.round(n) <= o or o + s <= off
                live[off] = a.round(n)
    for off in list(live):
        a.free(off)
    assert a.used == 0 and a.largest_free() == a.capacity  # fully coalesced


def test_bad_alignment() -> None:
    with pytest.raises(ConfigError):
        ExtentAllocator(1024, align=3)
    with pytest.raises(ConfigError):
        ExtentAllocator(100, align=256)
