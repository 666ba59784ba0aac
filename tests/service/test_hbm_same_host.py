"""A same-host client puts to a node whose top tier is HBM with its default transport
(issue 31, item 4): a real ``kvstore serve`` child whose HBM tier is its code on host
memory (``--hbm-device cpu``), so this runs without a GPU; tests/gpu/test_tiers_cuda.py
runs the same with CUDA. The bytes go through the shared segment and stay in DRAM
(kvstore/server/shm_writes.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.server_fixtures import ServerFactory

pytest_plugins = ["tests.support.server_fixtures"]


@pytest.mark.process
def test_a_same_host_put_to_an_hbm_node_succeeds_with_transport_auto(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(hbm_bytes="16MiB", hbm_device="cpu")
    rng = np.random.default_rng(31)
    values = [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(4)]
    keys = [bytes([i]) * 16 for i in range(4)]
    with server.client() as c:
        assert c.put(keys[0], values[0]) is True
        assert c.transport == "shm"  # the default, auto, chose shared memory
        assert c.batch_put(keys[1:], values[1:]) == [True, True, True]
        for k, v in zip(keys, values, strict=True):
            out = np.zeros_like(v)
            assert c.get_into(k, out) is True and np.array_equal(out, v)
        tiers = c.stats()["tiers"]
    assert tiers["dram"]["blocks"] == 4 and tiers["hbm"]["blocks"] == 0
