"""Shared memory has a tenant boundary (issue 17, attack 6): the DRAM segment holds every
tenant's blocks and any process of the server's Unix user can open it, so a server whose
tokens name two or more tenants keeps DRAM in private memory by default. No segment
exists, and its same-host clients use the Unix data socket. One tenant, or tenants that
trust each other (``shared_memory=all_tenants``), get the segment as before."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.conn import DataConn
from kvstore.config import NodeConfig, ServerConfig
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server.serve import shared_memory_for
from kvstore.wire.frames import Op
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA, BRAVO, ServerProcess, write_tokens

pytest_plugins = ["tests.support.server_fixtures"]

SHM = Path("/dev/shm")
SECRET = b"tenant-alpha-secret-bytes-0123456789abcdef"  # no other block holds these bytes


def _payload() -> np.ndarray:
    return np.frombuffer(SECRET * (4096 // len(SECRET) + 1), dtype=np.uint8)[:4096].copy()


def _segments_of(server: ServerProcess) -> list[Path]:
    """Files under /dev/shm that this server made (its segments are named by its pid)."""
    assert server.proc is not None
    return sorted(SHM.glob(f"kvstore-{server.proc.pid}-*"))


def _anything_holds(needle: bytes) -> list[Path]:
    """Every file in /dev/shm that a process of this Unix user can read and that holds
    ``needle``: what a same-user snooper, holding no token, could find."""
    found = []
    for path in SHM.iterdir():
        try:
            if needle in path.read_bytes():
                found.append(path)
        except OSError:
            continue
    return found


@pytest.mark.process
def test_two_tenants_get_no_segment_and_a_snooper_finds_nothing(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(shared_memory="auto")  # the default; three tenants
    assert server.facts["shm_name"] is None
    assert _segments_of(server) == []
    key = b"private-dram-key"
    with server.client(ALPHA) as a:  # same host, transport auto: the Unix data socket
        assert a.put(key, _payload()) is True
        got = np.frombuffer(a.get(key), dtype=np.uint8)
        assert (got == _payload()).all()
        assert a.transport == "tcp"  # bytes through the kernel, tenant-checked per call
    assert _anything_holds(SECRET) == []  # not in /dev/shm, not in an index there

    deadline = time.monotonic() + 10
    b = DataConn.open(("127.0.0.1", server.data_port), BRAVO.token, deadline=deadline)
    try:
        assert (b.info.shm_name, b.info.shm_index) == ("", "")
        meta = pb.ValueMeta(dtype="uint8", shape=[64], kind=0, nbytes=64)
        reserve = pb.PutRequest(items=[pb.PutItem(key=b"b-wants-a-lease!", meta=meta)])
        res = b.call(Op.RESERVE, reserve, pb.PutResponse, deadline)[0].results[0]
        assert not res.lease_id and res.error.code, res  # no segment to write into
        opened, _ = b.call(Op.LEASE, pb.GetRequest(keys=[key]), pb.GetResponse, deadline)
        assert not opened.blocks[0].found  # A's key is not B's: a miss, no offset
        assert opened.blocks[0].offset == -1 and not opened.shm_name
    finally:
        b.close()
    b2 = server.client(BRAVO, transport="shm")
    try:
        with pytest.raises(KVStoreError, match="no shared memory"):
            b2.put(b"bravo-wants-shm!", _payload()[:64])
    finally:
        b2.close()


@pytest.mark.process
def test_one_tenant_maps_the_segment(server_factory: ServerFactory, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "one.toml", (ALPHA,), secret="")
    server = server_factory(shared_memory="auto", tokens_file=tokens)
    assert server.facts["shm_name"] and _segments_of(server)
    with server.client(ALPHA) as a:
        assert a.put(b"one-tenant-key!!", _payload()) is True
        assert a.transport == "shm"


@pytest.mark.process
def test_off_keeps_even_one_tenant_private(server_factory: ServerFactory, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "one.toml", (ALPHA,), secret="")
    server = server_factory(shared_memory="off", tokens_file=tokens)
    assert server.facts["shm_name"] is None and _segments_of(server) == []
    with server.client(ALPHA) as a:
        assert a.put(b"off-tenant-key!!", _payload()) is True
        assert (np.frombuffer(a.get(b"off-tenant-key!!"), np.uint8) == _payload()).all()


def test_the_choice_follows_the_tenants() -> None:
    node = NodeConfig(dram_bytes=1 << 20)
    one, two = frozenset({"a"}), frozenset({"a", "b"})

    def shared(mode: str, tenants: frozenset[str]) -> bool:
        cfg = ServerConfig(allow_anonymous=True, shared_memory=mode)
        return shared_memory_for(node, cfg, tenants).shared_dram

    assert shared("auto", one) and shared("auto", frozenset())
    assert not shared("auto", two)
    assert shared("all_tenants", two)
    assert not shared("off", one)
    named = node.replace(shm_name="kv-node-a")
    with pytest.raises(ConfigError, match="all_tenants"):  # a name for a segment it won't make
        shared_memory_for(named, ServerConfig(allow_anonymous=True), two)
    with pytest.raises(ConfigError, match="shared_memory"):
        ServerConfig(allow_anonymous=True, shared_memory="everyone")


def test_a_private_dram_node_has_no_segment() -> None:
    from kvstore import StoreNode

    before = set(os.listdir(SHM))
    with StoreNode(dram_bytes=1 << 20, shared_dram=False) as n:
        assert n.shm_name is None and n.publish_index() == ""
        assert n.put(b"private-node-key", _payload()) is True
        assert set(os.listdir(SHM)) - before == set()
