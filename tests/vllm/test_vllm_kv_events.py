"""A kvstore node's KV events decoded with vLLM's own event classes (issue 20): the
subscriber a router built for vLLM engines (vllm.distributed.kv_events) reads a
``kvstore serve`` node's stream as it reads an engine's. Runs in .venv-vllm."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("msgpack")

from kvstore.tenants import Principal  # noqa: E402
from kvstore.wire.shards import shard_of  # noqa: E402
from tests.support.kv_events import Subscriber, replay  # noqa: E402
from tests.support.server_process import ALPHA, ServerProcess, base_flags  # noqa: E402

pytestmark = pytest.mark.process


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    flags = {
        **base_flags(tmp_path),
        "kv_events_endpoint": "tcp://127.0.0.1:*",
        "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
        "kv_events_block_size": 16,
    }
    s = ServerProcess(tmp_path, flags).start()
    try:
        yield s
    finally:
        s.stop()


def test_vllm_decodes_the_node_stream(server: ServerProcess) -> None:
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    sub = Subscriber(server.facts["kv_events"])
    try:
        time.sleep(0.3)
        raw = [f"vllm-events-{i:04d}".encode() for i in range(4)]
        with server.client(ALPHA) as c:
            assert c.batch_put(raw, [np.full(8192, i, np.uint8) for i in range(4)]) == [True] * 4
            info = c.server_info
            scope = base64.b64decode(info.get("scope_key", ""))
            keys = set(Principal(info["tenant"], scope_key=scope).scope_all(raw))

            batches = sub.until(decoder.decode, lambda b: _stored(b) >= keys, 10)
            assert _stored(batches) >= keys
            events = [e for b in batches for e in b.events]
            assert all(isinstance(b, kv_events.KVEventBatch) for b in batches)
            assert all(e.medium == kv_events.MEDIUM_CPU and e.block_size == 16 for e in events)
            assert c.remove(raw[:2]) == 2
            gone = sub.until(
                decoder.decode,
                lambda b: any(isinstance(e, kv_events.BlockRemoved) for x in b for e in x.events),
                10,
            )
            removed = {
                h
                for b in gone
                for e in b.events
                if isinstance(e, kv_events.BlockRemoved)
                for h in e.block_hashes
            }
            assert removed == set(Principal(info["tenant"], scope_key=scope).scope_all(raw[:2]))
        again = [decoder.decode(p) for _, p in replay(server.facts["kv_events_replay"], 0)]
        assert _stored(again) >= keys  # a late subscriber catches up through replay
    finally:
        sub.close()


def test_vllm_reads_each_shard_as_a_data_parallel_rank(tmp_path: Path) -> None:
    """``kvstore serve --shards 2``: vLLM's decoder reads each shard's stream, each
    batch says its shard as ``data_parallel_rank``, and each stream lists exactly the
    blocks of its shard."""
    flags = {
        **base_flags(tmp_path),
        "shards": 2,
        "max_value_bytes": "4MiB",
        "kv_events_endpoint": "tcp://127.0.0.1:*",
        "kv_events_block_size": 16,
    }
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    server = ServerProcess(tmp_path, flags).start()
    subs: list[Subscriber] = []
    try:
        endpoints = [s["kv_events"] for s in server.facts["shards"]]
        assert endpoints[0] == server.facts["kv_events"] and len(set(endpoints)) == 2
        subs = [Subscriber(e) for e in endpoints]
        raw = [i.to_bytes(2, "big") + b"vllm-dp-events" for i in range(16)]
        with server.client(ALPHA) as c:
            info = c.server_info
            scope = Principal(info["tenant"], scope_key=base64.b64decode(info["scope_key"])).scope
            for rank, sub in enumerate(subs):  # joined once a probe of its shard arrives
                probes = (i.to_bytes(16, "big") for i in range(1 << 20))
                probe = next(k for k in probes if shard_of(scope(k), 2) == rank)
                sub.join(lambda p=probe: c.put(p, np.zeros(64, np.uint8)))
            assert c.batch_put(raw, [np.full(4096, 1, np.uint8)] * 16) == [True] * 16
        keys = {scope(k) for k in raw}
        for rank, sub in enumerate(subs):
            mine = {scope(k) for k in raw if shard_of(scope(k), 2) == rank}
            batches = sub.until(decoder.decode, lambda b, m=mine: _stored(b) >= m, 10)
            assert {b.data_parallel_rank for b in batches} == {rank}
            assert _stored(batches) & keys == mine
    finally:
        for sub in subs:
            sub.close()
        server.stop()


def _stored(batches: list[Any]) -> set[bytes]:
    return {
        h
        for b in batches
        for e in b.events
        if isinstance(e, kv_events.BlockStored)
        for h in e.block_hashes
    }
