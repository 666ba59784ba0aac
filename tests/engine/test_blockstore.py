"""engine/blockstore.py's breaker as the serving workers use it: calls raise as the
store would, a node that is gone is skipped for the cool-down, and the next call after
it reconnects in the calling thread. (Its never-raising face, the vLLM connector's, is
covered in tests/vllm/test_vllm_parts.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.blockstore import BlockStore, GuardedStore, NodeStore, NullStore
from engine.serving.stores import HandoffReader
from kvstore import Namespace, StoreNode, prefix_keys
from kvstore.errors import InvalidValue, KVStoreError, Unavailable

NS = Namespace("tiny", "float32:L2:H1:D4:B4:R0")


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


class Failing:
    """A client of a node whose calls raise ``error``; counts opens and closes."""

    def __init__(self, inner: BlockStore, error: Exception | None) -> None:
        self.inner, self.error, self.closed = inner, error, 0

    def match_prefix(self, keys: Any) -> int:
        if self.error is not None:
            raise self.error
        return self.inner.match_prefix(keys)

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        if self.error is not None:
            raise self.error
        return self.inner.put(key, value, namespace=namespace)

    def close(self) -> None:
        self.closed += 1


def test_serving_face_raises_skips_while_down_and_reconnects_inline() -> None:
    keys = prefix_keys(range(8), 4, NS)
    block = torch.zeros(NS.kv_layout.block_shape())
    with StoreNode(dram_bytes="1MiB") as node:
        clients: list[Failing] = []
        error: list[Exception | None] = [Unavailable("node gone")]

        def connect() -> Any:
            clients.append(Failing(NodeStore(node, NS), error[0]))
            return clients[-1]

        clock = Clock()
        gs = GuardedStore(connect, retry_after_s=2.0, spawn=None, clock=clock)
        with pytest.raises(Unavailable, match="node gone"):  # the first call connects
            gs.match_prefix(keys)
        assert not gs.available and gs.stats.store_errors == 1 and clients[0].closed == 1
        with pytest.raises(Unavailable, match="marked down"):  # skipped: no new client
            gs.match_prefix(keys)
        assert len(clients) == 1 and gs.stats.skipped_calls == 1
        clock.now += 2.0
        error[0] = None
        assert gs.put(keys[0], block, namespace=NS) is True  # reconnected in this call
        assert gs.match_prefix(keys) == 1 and len(clients) == 2 and gs.available


def test_serving_face_passes_request_errors_without_marking_down() -> None:
    with StoreNode(dram_bytes="1MiB") as node:
        client = Failing(NodeStore(node, NS), InvalidValue("refused value"))
        gs = GuardedStore(lambda: client, retry_after_s=2.0, spawn=None)
        for _ in range(2):
            with pytest.raises(InvalidValue):
                gs.put(b"k" * 16, b"x", namespace=NS)
        assert gs.available and gs.stats.store_errors == 0 and client.closed == 0


def test_handoff_reader_reads_the_source_and_refuses_writes() -> None:
    keys = prefix_keys(range(8), 4, NS)
    block = torch.randn(NS.kv_layout.block_shape())
    with StoreNode(dram_bytes="1MiB") as node:
        source = GuardedStore(lambda: NodeStore(node, NS), retry_after_s=2.0, spawn=None)
        assert source.put(keys[0], block, namespace=NS)
        reader = HandoffReader(None, source)
        outs = [torch.empty_like(block) for _ in keys]
        assert reader.batch_get_into(keys, outs) == [True, False]
        assert torch.equal(outs[0], block) and reader.from_source == 1
        assert reader.match_prefix(keys) == 1
        with pytest.raises(KVStoreError, match="does not write"):
            reader.batch_put(keys, outs)


def test_a_null_store_misses_and_drops_or_refuses_writes() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    outs = [np.zeros(4, dtype=np.uint8) for _ in keys]
    dropping, refusing = NullStore(), NullStore(refuse="no store node here")
    for store in (dropping, refusing):
        assert store.batch_get_into(keys, outs) == [False] * 3
        assert not store.get_into(keys[0], outs[0])
        assert store.match_prefix(keys) == 0 and store.remove(keys) == 0
    assert all(not o.any() for o in outs)
    assert dropping.batch_put(keys, outs) == [False] * 3
    assert dropping.put(keys[0], outs[0]) is False
    with pytest.raises(KVStoreError, match="no store node here"):
        refusing.batch_put(keys, outs)
    with pytest.raises(KVStoreError, match="no store node here"):
        refusing.put(keys[0], outs[0])
