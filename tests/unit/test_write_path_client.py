"""A write refused for lack of room is retried by the client within its deadline (issue
18): a real NodeClient over the in-memory network (tests/support/memory_net.py) against
a real Gateway and StoreNode whose every block a reader holds."""

from __future__ import annotations

import threading

import torch

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.config import NodeConfig
from kvstore.errors import KVStoreError
from kvstore.node.store import StoreNode
from tests.support.memory_net import TOKEN, MemoryNetwork, MemoryServer
from tests.support.waiting import wait_until

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)
EXTENT = 8448  # 128-byte header + 8 KiB payload, in 256-byte units
ADDR = "node-a:7400"


def _block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def test_a_put_refused_for_room_is_retried_within_its_deadline() -> None:
    net = MemoryNetwork()
    node = StoreNode(NodeConfig(node_id="a", dram_bytes=3 * EXTENT, warm=False))
    net.add(MemoryServer(node, ADDR))
    keys = list(prefix_keys(list(range(64)), 16, NS))
    try:
        with StoreClient(ADDR, token=TOKEN, namespace=NS, connector=net, backoff_s=0.2) as c:
            assert c.batch_put(keys[:3], [_block(i) for i in range(3)]) == [True] * 3
            stored = node.snapshot()
            reads = [node.open_read(k) for k, _, _ in stored]  # every block held: no room
            outcome: list[bool | KVStoreError] = []

            def put() -> None:
                try:
                    outcome.append(c.put(keys[3], _block(3)))
                except KVStoreError as exc:
                    outcome.append(exc)

            t = threading.Thread(target=put)
            t.start()
            try:
                wait_until(lambda: c.counters.get("item_retries") >= 1 or outcome, "a retry")
            finally:
                for r in reads:
                    assert r is not None
                    node.close_read(r)
                t.join(10)
            assert outcome == [True]
            assert c.exists(keys[:4]) == [False, True, True, True]
    finally:
        net.close()
