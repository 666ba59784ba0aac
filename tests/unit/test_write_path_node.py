"""Write-path races of one node (issue 18), against real tiers: shared-memory DRAM and an
lmdb + slab SSD tier in tmp_path.

- Concurrent writers whose room is being made by demotions in flight wait for them
  instead of failing with a false "every block in it is pinned".
- An SSD block read back (promoted to DRAM) keeps its SSD copy until the SSD needs the
  room, so a restart still finds it and demoting it again writes nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, prefix_keys
from kvstore.node import claims
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind

MIB = 1 << 20
NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return list(prefix_keys([seed] * 7 + list(range(n * 16)), 16, NS))[:n]


def _value(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, dtype=np.uint8)


def test_concurrent_writers_wait_for_demotions_instead_of_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 writers of 8 MiB blocks into 32 MiB of DRAM (3 blocks fit) + SSD: while one
    writer demotes a victim, the others find every block pinned or moving; they must
    wait for the demotion, not fail. (The wait's bound is raised: on a machine busy
    enough, a demotion of 8 MiB can outlast the 2 s default, and the bound is not what
    this test is about.)"""
    monkeypatch.setattr(claims, "ROOM_WAIT_S", 30.0)
    writers, per_writer = 4, 6
    keys = _keys(writers * per_writer, seed=1)
    with StoreNode(
        node_id="w", dram_bytes=32 * MIB, ssd_path=str(tmp_path / "ssd"), ssd_bytes=512 * MIB
    ) as node:
        start = threading.Barrier(writers)
        failures: list[KVStoreError] = []

        def write(w: int) -> None:
            start.wait(timeout=10)
            for j in range(per_writer):
                i = w * per_writer + j
                try:
                    node.put(keys[i], _value(i, 8 * MIB))
                except KVStoreError as exc:
                    failures.append(exc)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        assert all(node.exists(keys))
        out = np.empty(8 * MIB, dtype=np.uint8)
        for i in (0, len(keys) // 2, len(keys) - 1):
            assert node.get_into(keys[i], out) and out[0] == i % 251 and out[-1] == i % 251


def _small_node(path: Path, ssd_blocks: int = 64) -> StoreNode:
    return StoreNode(
        node_id="k",
        dram_bytes=4 * (MIB + 256),
        ssd_path=str(path),
        ssd_bytes=ssd_blocks * (MIB + 4096),
        warm=False,
    )


def test_a_promoted_block_keeps_its_ssd_copy_across_a_restart(tmp_path: Path) -> None:
    keys = _keys(8, seed=2)
    with _small_node(tmp_path / "ssd") as node:
        for i, k in enumerate(keys):
            node.put(k, _value(i, MIB))
        node.evict(TierKind.DRAM, 0)
        assert all(node.tier_of(k) is TierKind.SSD for k in keys)
        out = np.empty(MIB, dtype=np.uint8)
        for i, k in enumerate(keys[:3]):  # promoted to DRAM on their hits
            assert node.get_into(k, out) and out[0] == i
            assert node.tier_of(k) is TierKind.DRAM
        node.evict(TierKind.DRAM, 0)  # demoting them again: back onto their kept copies
        assert node.counters.get("kept_copies_reused") == 3
        for k in keys[:2]:
            assert node.get_into(k, out)  # promoted once more, still with a copy below
    with _small_node(tmp_path / "ssd") as node:  # DRAM is gone: what the SSD kept
        assert node.exists(keys) == [True] * len(keys)
        out = np.empty(MIB, dtype=np.uint8)
        for i, k in enumerate(keys):
            assert node.get_into(k, out) and out[0] == i and out[-1] == i


def test_kept_copies_go_before_ssd_blocks(tmp_path: Path) -> None:
    """An SSD that fills up drops copies of blocks that are also in DRAM first: nothing
    the node holds is lost for them."""
    keys = _keys(8, seed=3)
    out = np.empty(MIB, dtype=np.uint8)
    with _small_node(tmp_path / "ssd", ssd_blocks=6) as node:
        for i, k in enumerate(keys[:6]):
            node.put(k, _value(i, MIB))
        node.evict(TierKind.DRAM, 0)  # the SSD is full
        for k in keys[:3]:
            assert node.get_into(k, out)  # 3 in DRAM, each with its copy on the SSD
        node.put(keys[6], _value(6, MIB))  # DRAM full now
        for k in keys[:3]:
            assert node.get_into(k, out)  # keys[6] is DRAM's next victim
        node.put(keys[7], _value(7, MIB))  # keys[6] goes down: room from a kept copy
        assert node.tier_of(keys[6]) is TierKind.SSD
        assert node.counters.get("kept_copies_dropped") == 1
        assert node.counters.get("evictions_ssd") == 0
        assert node.exists(keys) == [True] * len(keys)
        for i, k in enumerate(keys):
            assert node.get_into(k, out) and out[0] == i
        node.remove(keys)  # a removed block's copy goes with it
        assert node.stats()["tiers"]["ssd"]["used"] == 0
