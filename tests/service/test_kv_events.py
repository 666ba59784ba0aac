"""A node publishes its block events in vLLM's KV-events format (issue 20): ZMQ PUB
frames (topic, 8-byte sequence, msgpack ``[ts, events]``; ``[ts, events, shard]``
from each shard of a sharded node, as vLLM's data-parallel ranks), BlockStored on a write,
BlockRemoved on a remove, BlockRemoved + BlockStored when a block changes tier, a
replay endpoint that resends what a subscriber missed, and a full re-list after the
publisher fell behind. The same stream decoded with vLLM's own classes:
tests/vllm/test_vllm_kv_events.py. The served node's payloads are checked on the
in-memory network too (tests/support/memory_fixtures.py), in the hermetic run."""

from __future__ import annotations

import base64
import os
from typing import Any

import msgpack
import numpy as np
import pytest

from kvstore.events import BlockMoved, BlockRemoved, BlockStored, EventQueue
from kvstore.server.kv_events import KVEventsPublisher
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from kvstore.wire.shards import shard_of
from tests.support.kv_events import Subscriber, replay
from tests.support.memory_fixtures import MemoryFactory, Served
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA, principal_of
from tests.support.sharded_node import ShardedFactory

KIB = 1 << 10


def home(key: bytes, count: int = 2) -> int:
    """The shard of a 2-shard node that holds ALPHA's ``key`` (by its stored key)."""
    return shard_of(principal_of(ALPHA).scope(key), count)


def _decode(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False)


def _events(batches: list[Any]) -> list[dict[str, Any]]:
    return [e for _, events, *_ in batches for e in events]


def _hashes(batches: list[Any], kind: str, medium: str | None = None) -> set[bytes]:
    return {
        h
        for e in _events(batches)
        if e["type"] == kind and (medium is None or e["medium"] == medium)
        for h in e["block_hashes"]
    }


KV_EVENT_FLAGS = {
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
    "kv_events_block_size": 32,
}


@pytest.mark.process
def test_a_served_node_publishes_stores_and_removes(server_factory: ServerFactory) -> None:
    server = server_factory(**KV_EVENT_FLAGS)
    endpoint = server.facts["kv_events"]
    assert endpoint.startswith("tcp://127.0.0.1:")
    _publishes_stores_and_removes(server, endpoint, server.facts["kv_events_replay"])


def test_a_node_on_the_memory_network_publishes_stores_and_removes(
    memory_factory: MemoryFactory,
) -> None:
    """The same payloads from the same publisher, wired to the node as ``kvstore serve``
    wires it (its settings, the node's event queue and snapshot), without the process."""
    server = memory_factory(**KV_EVENT_FLAGS)
    node, c = server.node, server.server.config
    pub = KVEventsPublisher(
        node.events.tap(),
        lambda: [(bytes(k), tier) for k, tier, _ in node.snapshot()],
        c.kv_events_endpoint,
        replay_endpoint=c.kv_events_replay_endpoint,
        topic=c.kv_events_topic,
        block_size=c.kv_events_block_size,
    )
    try:
        _publishes_stores_and_removes(server, pub.endpoint, pub.replay_endpoint)
    finally:
        node.events.untap(pub.tap)
        pub.close()


def _publishes_stores_and_removes(server: Served, endpoint: str, replay_endpoint: str) -> None:
    sub = Subscriber(endpoint)
    try:
        keys = [f"kv-events-{i:06d}".encode() for i in range(3)]
        with server.client(ALPHA) as c:
            probe = np.zeros(KIB, np.uint8)
            sub.join(lambda: c.put(b"kv-events-probe!", probe))  # joined once one arrives
            values = [np.full(64 * KIB, i, np.uint8) for i in range(3)]
            assert c.batch_put(keys, values) == [True] * 3
            # the node publishes the keys it stores: tenant-scoped (kvstore/tenants.py);
            # a tenant's router maps its own keys with the scope key INFO gave it
            info = c.server_info
            scope = base64.b64decode(info.get("scope_key", ""))
            keys = Principal(info["tenant"], scope_key=scope).scope_all(keys)
            batches = sub.until(_decode, lambda b: _hashes(b, "BlockStored") >= set(keys), 10)
            stored = [e for e in _events(batches) if e["type"] == "BlockStored"]
            assert _hashes(batches, "BlockStored", "CPU") >= set(keys)
            assert all(e["block_size"] == 32 and e["token_ids"] == [] for e in stored)
            assert all(e["parent_block_hash"] is None for e in stored)
            assert c.remove([b"kv-events-000000"]) == 1
            batches = sub.until(_decode, lambda b: keys[0] in _hashes(b, "BlockRemoved"), 10)
            assert _hashes(batches, "BlockRemoved", "CPU") == {keys[0]}
        seqs = [s for s, _ in sub.seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one per batch, in order
        again = replay(replay_endpoint, 0)
        assert [s for s, _ in again] == list(range(len(again)))
        assert dict(again)[seqs[-1]] == sub.seen[-1][1]  # the same bytes, resent
    finally:
        sub.close()


def test_tier_moves_and_an_overflow_are_said_in_vllm_terms() -> None:
    """In process, with a real ZMQ socket: a demotion is BlockRemoved(CPU) +
    BlockStored(STORAGE); a tap that overflowed makes the next batch AllBlocksCleared
    followed by every block the node holds."""
    node_events = EventQueue()
    tap = node_events.tap(maxlen=4)
    held = [(b"a" * 16, TierKind.DRAM), (b"b" * 16, TierKind.SSD)]
    pub = KVEventsPublisher(tap, lambda: held, "tcp://127.0.0.1:*", interval_s=3600)
    sub = Subscriber(pub.endpoint)
    try:
        probe = b"p" * 16

        def publish_probe() -> None:
            node_events.put(BlockStored(probe, TierKind.DRAM, 1, b""))
            pub.flush()

        sub.join(publish_probe)
        sub.seen.clear()
        node_events.put(BlockStored(b"a" * 16, TierKind.DRAM, 10, b""))
        node_events.put(BlockMoved(b"a" * 16, TierKind.DRAM, TierKind.SSD))
        node_events.put(BlockRemoved(b"a" * 16, TierKind.SSD))
        pub.flush()  # the thread's interval is an hour: only this call publishes

        def not_probe(batches: list[Any]) -> list[dict[str, Any]]:
            return [e for e in _events(batches) if e["block_hashes"] != [probe]]

        got = not_probe(sub.until(_decode, lambda b: len(not_probe(b)) >= 4, 5))
        assert [(e["type"], e["medium"]) for e in got] == [
            ("BlockStored", "CPU"),
            ("BlockRemoved", "CPU"),
            ("BlockStored", "STORAGE"),
            ("BlockRemoved", "STORAGE"),
        ]
        for i in range(6):  # more than the tap holds: it drops, the publisher re-lists
            node_events.put(BlockStored(bytes([i]) * 16, TierKind.DRAM, 1, b""))
        pub.flush()
        cleared = {"type": "AllBlocksCleared"}
        batches = sub.until(_decode, lambda b: any(x[1][:1] == [cleared] for x in b), 5)
        last = next(x[1] for x in batches if x[1][:1] == [cleared])
        assert [(e["type"], e["medium"], e["block_hashes"]) for e in last[1:]] == [
            ("BlockStored", "CPU", [b"a" * 16]),
            ("BlockStored", "STORAGE", [b"b" * 16]),
        ]
    finally:
        sub.close()
        pub.close()
        node_events.untap(tap)


def test_each_shard_of_a_sharded_node_publishes_its_own_blocks(
    sharded_factory: ShardedFactory,
) -> None:
    """``--shards 2`` with KV events: one stream per shard, as vLLM's data-parallel
    ranks publish (the rank in every batch); each lists exactly its own shard's blocks,
    and together they list every block the node stored."""
    node = sharded_factory(**KV_EVENT_FLAGS)
    pubs = [node.server(i).kv_events for i in range(node.count)]
    assert all(p is not None for p in pubs)
    subs = [Subscriber(p.endpoint) for p in pubs if p is not None]
    scope = principal_of(ALPHA).scope
    try:
        with node.client(ALPHA) as c:
            for i, sub in enumerate(subs):  # a probe key of each shard, until it arrives
                probe = next(k for k in iter(lambda: os.urandom(16), None) if home(k) == i)
                sub.join(lambda p=probe: c.put(p, np.zeros(KIB, np.uint8)))
            keys = [os.urandom(16) for _ in range(24)]
            assert c.batch_put(keys, [np.full(KIB, 7, np.uint8)] * 24) == [True] * 24
        for i, sub in enumerate(subs):
            mine = {scope(k) for k in keys if home(k) == i}
            batches = sub.until(_decode, lambda b, m=mine: _hashes(b, "BlockStored") >= m, 10)
            assert {b[2] for b in batches} == {i}  # data_parallel_rank: the shard
            assert _hashes(batches, "BlockStored") & {scope(k) for k in keys} == mine
    finally:
        for sub in subs:
            sub.close()
