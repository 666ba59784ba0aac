"""``kvstore serve --shards 2`` as a user runs it: the supervisor, its shards, their
restarts, their SSD after a crash, one /metrics, and a clean stop.

Each shard is reached here with a plain NodeClient of its own address, placing keys by
``shard_of`` as every client does, so these tests hold the server to the contract
without leaning on the sharded client (tests/service/test_sharded_client*.py).
"""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client.store import NodeClient
from kvstore.shm.index import index_name
from kvstore.wire.shards import shard_of
from tests.support.server_process import ALPHA, ServerProcess, base_flags, principal_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process

MIB = 1024**2


def _flags(tmp: Path, **extra: Any) -> dict[str, Any]:
    flags = base_flags(tmp)
    flags.update(
        shards=2, node_id="box", dram_bytes="32MiB", max_value_bytes="4MiB", metrics_port=0
    )
    flags.update(extra)
    return flags


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path, _flags(tmp_path)).start()
    try:
        yield srv
    finally:
        srv.stop()
        for s in srv.facts.get("shards", []):
            _unlink_segment(s.get("shm_name"))


def _unlink_segment(name: str | None) -> None:
    if name:
        Path("/dev/shm", name).unlink(missing_ok=True)
        Path("/dev/shm", index_name(name)).unlink(missing_ok=True)


def _client(port: int) -> NodeClient:
    return NodeClient.connect(
        f"127.0.0.1:{port}", token=ALPHA.token, timeout_s=10.0, connect_timeout_s=20.0
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _block(i: int) -> np.ndarray:
    return np.full(MIB, i % 251, dtype=np.uint8)


def _keys_of(shard: int, n: int) -> list[bytes]:
    """ALPHA's keys that live on ``shard`` (placement is by the stored, scoped key)."""
    scope = principal_of(ALPHA).scope
    out, i = [], 0
    while len(out) < n:
        k = i.to_bytes(16, "little")
        if shard_of(scope(k), 2) == shard:
            out.append(k)
        i += 1
    return out


def test_ready_line_info_and_one_metrics_page(sharded: ServerProcess) -> None:
    facts = sharded.facts
    shards = facts["shards"]
    assert facts["node_id"] == "box" and facts["pid"] == sharded.pid
    assert [s["node_id"] for s in shards] == ["box.s0", "box.s1"]
    assert facts["port"] == shards[0]["port"] != shards[1]["port"]
    assert len({s["pid"] for s in shards} | {sharded.pid}) == 3
    with _client(sharded.port) as c:
        info = c.server_info
    assert (info["group"], info.get("shard", 0), info["shard_count"]) == ("box", 0, 2)
    listed = [(s.get("index", 0), s["address"]) for s in info["shards"]]
    assert listed == [(0, sharded.address), (1, f"127.0.0.1:{shards[1]['port']}")]
    url = f"http://127.0.0.1:{facts['metrics_port']}/metrics"
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'kvstore_node_info{node_id="box.s0",shard="0"' in page
    assert 'kvstore_node_info{node_id="box.s1",shard="1"' in page
    assert "kvstore_shards 2.0" in page


def test_each_shard_holds_its_keys(sharded: ServerProcess) -> None:
    ports = [s["port"] for s in sharded.facts["shards"]]
    for shard, port in enumerate(ports):
        with _client(port) as c:
            keys = _keys_of(shard, 4)
            assert c.batch_put(keys, [_block(i) for i in range(4)]) == [True] * 4
            assert c.stats()["tiers"]["dram"]["blocks"] == 4
            out = np.empty(MIB, dtype=np.uint8)
            assert c.get_into(keys[2], out) and (out == 2).all()


def test_a_killed_shard_comes_back_on_its_port_with_its_ssd(sharded: ServerProcess) -> None:
    one = sharded.facts["shards"][1]
    keys = _keys_of(1, 40)  # 40 MiB into a 16 MiB DRAM share: most go down to SSD
    with _client(one["port"]) as c:
        for i, k in enumerate(keys):
            c.put(k, _block(i))
        wait_until(lambda: c.stats()["tiers"]["ssd"]["blocks"] >= 20, "blocks demoted to SSD")
        on_ssd = c.stats()["tiers"]["ssd"]["blocks"]
    os.kill(one["pid"], signal.SIGKILL)
    _unlink_segment(one["shm_name"])
    wait_until(lambda: not _alive(one["pid"]), "the shard to die")
    with _client(one["port"]) as c:  # the supervisor restarts it on the same port
        assert c.server_info["pid"] != one["pid"]
        out = np.empty(MIB, dtype=np.uint8)
        hits = 0
        for i, k in enumerate(keys):
            if c.get_into(k, out):
                assert (out == i % 251).all()  # never wrong bytes
                hits += 1
    assert hits >= on_ssd  # every block that was on SSD survived the crash
    assert _alive(sharded.facts["shards"][0]["pid"])  # its sibling never noticed
    assert sharded.proc is not None and sharded.proc.poll() is None


def test_sigterm_stops_every_shard(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, _flags(tmp_path)).start()
    pids = [s["pid"] for s in srv.facts["shards"]]
    assert srv.stop() == 0
    wait_until(lambda: not any(_alive(p) for p in pids), "every shard to stop")
    for s in srv.facts["shards"]:  # each shard unlinked its own segment
        assert not Path("/dev/shm", s["shm_name"]).exists()


def test_settings_no_shard_can_serve_are_one_line_errors(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, _flags(tmp_path, max_value_bytes="64MiB"))
    with pytest.raises(RuntimeError, match="max_value_bytes"):
        srv.start()
    srv = ServerProcess(tmp_path, _flags(tmp_path, shards="lots"))
    with pytest.raises(RuntimeError, match="shards 'lots'"):
        srv.start()
