"""The gRPC control plane called directly, request limits, and ``kvstore serve`` settings."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.blocks import BlockHeader
from kvstore.cli import main
from kvstore.client.transport.shm import Segment
from kvstore.errors import BlockTooLarge, LimitExceeded
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.grpc_errors import error_from_rpc
from tests.support.server_process import ALPHA, ServerProcess

MD = bearer_metadata(ALPHA.token)


@pytest.fixture(scope="module")
def stub(store_server: ServerProcess) -> pb_grpc.StoreStub:
    channel = grpc.insecure_channel(store_server.address)
    yield pb_grpc.StoreStub(channel)
    channel.close()


def _meta(n: int) -> pb.ValueMeta:
    return pb.ValueMeta(dtype="uint8", shape=[n], kind=0, nbytes=n)


def _item(key: bytes, payload: bytes) -> pb.PutItem:
    return pb.PutItem(
        key=key,
        meta=_meta(len(payload)),
        payload=payload,
        checksum=xxhash.xxh3_64_intdigest(payload),
    )


def test_info_and_health(stub: pb_grpc.StoreStub, store_server: ServerProcess) -> None:
    info = stub.Info(pb.InfoRequest(), metadata=MD)
    assert info.tenant == "alpha" and not info.admin
    assert info.data_port == store_server.data_port
    assert info.shm_name == store_server.facts["shm_name"] and info.shm_size > 0
    assert list(info.tiers) == ["dram", "ssd"]
    health = stub.Health(pb.HealthRequest(), metadata=MD)
    assert health.status == pb.HealthResponse.SERVING and health.instance_id == info.instance_id


def test_inline_put_get_lookup_remove(stub: pb_grpc.StoreStub) -> None:
    keys = [b"grpc-inline-key" + bytes([i]) for i in range(3)]
    resp = stub.Put(
        pb.PutRequest(items=[_item(keys[0], b"hello"), _item(keys[1], b"world")]), metadata=MD
    )
    assert [r.stored for r in resp.results] == [True, True]
    bad = _item(keys[2], b"!")
    bad.checksum ^= 1
    assert (
        stub.Put(pb.PutRequest(items=[bad]), metadata=MD).results[0].error.code == "corrupt_block"
    )
    got = stub.Get(pb.GetRequest(keys=keys), metadata=MD)
    assert [b.found for b in got.blocks] == [True, True, False]
    assert got.blocks[0].payload == b"hello"
    assert BlockHeader.unpack(got.blocks[1].header).payload_len == 5
    assert list(stub.Lookup(pb.KeysRequest(keys=keys), metadata=MD).tier) == ["dram", "dram", ""]
    assert stub.MatchPrefix(pb.KeysRequest(keys=keys), metadata=MD).matched == 2
    assert stub.Remove(pb.KeysRequest(keys=keys), metadata=MD).removed == 2


def test_shared_memory_write_and_read_over_grpc(stub: pb_grpc.StoreStub) -> None:
    """The two-phase same-host path without the data socket (for other languages)."""
    key, payload = b"grpc-shm-key....", np.arange(4096, dtype=np.uint8)
    info = stub.Info(pb.InfoRequest(), metadata=MD)
    seg = Segment(info.shm_name, info.shm_size)
    try:
        res = stub.Reserve(
            pb.PutRequest(items=[pb.PutItem(key=key, meta=_meta(4096))]), metadata=MD
        ).results[0]
        assert res.lease_id and res.offset >= 0
        seg.extent(res.offset, 4096)[:] = payload
        commit = pb.CommitRequest(
            items=[pb.CommitItem(lease_id=res.lease_id, checksum=xxhash.xxh3_64_intdigest(payload))]
        )
        assert stub.Commit(commit, metadata=MD).results[0].stored
        again = stub.Commit(commit, metadata=MD).results[0]  # the lease is spent
        assert again.error.code == "reservation"

        opened = stub.OpenRead(pb.GetRequest(keys=[key]), metadata=MD)
        ref = opened.blocks[0]
        assert ref.lease_id and opened.lease_expires_ns > 0
        assert (seg.extent(ref.offset, 4096) == payload).all()
        closed = stub.CloseRead(pb.LeaseRequest(lease_ids=[ref.lease_id, 12345]), metadata=MD)
        assert (closed.released, closed.expired) == (1, 1)

        # Abort gives the space back.
        res = stub.Reserve(
            pb.PutRequest(items=[pb.PutItem(key=b"grpc-shm-abort..", meta=_meta(8))]), metadata=MD
        ).results[0]
        assert stub.Abort(pb.LeaseRequest(lease_ids=[res.lease_id]), metadata=MD).released == 1
        assert stub.Exists(pb.KeysRequest(keys=[b"grpc-shm-abort.."]), metadata=MD).present == [
            False
        ]
    finally:
        seg.close()


def test_stats_shape(stub: pb_grpc.StoreStub) -> None:
    stats = stub.Stats(pb.StatsRequest(), metadata=MD)
    assert {t.tier for t in stats.tiers} == {"dram", "ssd"}
    assert "connections" in stats.server and "leases" in stats.server


def test_limits(server_factory) -> None:
    server = server_factory(
        max_batch=8, max_value_bytes="64KiB", max_inline_bytes="16KiB", max_message_bytes="1MiB"
    )
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.StoreStub(channel)
    try:
        nine = [bytes([i]) * 16 for i in range(9)]
        with pytest.raises(grpc.RpcError) as e:
            stub.Exists(pb.KeysRequest(keys=nine), metadata=MD)
        assert isinstance(error_from_rpc(e.value), LimitExceeded)
        with pytest.raises(grpc.RpcError) as e:  # over max_inline_bytes
            stub.Put(pb.PutRequest(items=[_item(b"i" * 16, b"x" * 20000)]), metadata=MD)
        assert isinstance(error_from_rpc(e.value), LimitExceeded)
        with pytest.raises(grpc.RpcError) as e:  # over max_message_bytes (gRPC's own check)
            stub.Put(pb.PutRequest(items=[_item(b"m" * 16, b"x" * (2 << 20))]), metadata=MD)
        assert isinstance(error_from_rpc(e.value), LimitExceeded)

        with server.client(ALPHA, transport="tcp") as c:
            with pytest.raises(LimitExceeded, match="max_batch"):
                c.exists(nine)
            with pytest.raises(BlockTooLarge):
                c.put(b"v" * 16, np.zeros(128 << 10, dtype=np.uint8))
            # Below the client's pre-flight checks, the server enforces the same limit.
            res = _raw_put(c, b"w" * 16, 128 << 10)
            assert res.results[0].error.code == "block_too_large"
            assert c.exists([b"w" * 16]) == [False]  # and the connection is still in step
    finally:
        channel.close()


def _raw_put(client, key: bytes, n: int) -> pb.PutResponse:
    """A PUT frame that skips the client's own size check."""
    import time

    from kvstore.wire.frames import Op

    payload = np.zeros(n, dtype=np.uint8)
    req = pb.PutRequest(
        items=[pb.PutItem(key=key, meta=_meta(n), checksum=xxhash.xxh3_64_intdigest(payload))]
    )
    with client._pool.connection(time.monotonic() + 5) as (conn, _t):
        resp, _ = conn.call(Op.PUT, req, pb.PutResponse, time.monotonic() + 5, [payload], n)
    return resp


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["--port", "http"], {}, "port: expected an integer"),
        (["--port", "70000"], {}, "not a TCP port"),
        ([], {}, "auth: set auth_token or tokens_file"),
        (["--dram-bytes", "4XB"], {}, "dram_bytes: cannot parse size"),
        (["--tls-cert", "/nonexistent.pem", "--allow-anonymous"], {}, "tls_cert and tls_key"),
        (["--tokens-file", "/nonexistent.toml"], {}, "tokens_file: no such file"),
        (["--policy", "random"], {}, "policy 'random'"),
        ([], {"KVSTORE_LEASE_TTL_S": "soon"}, "lease_ttl_s: expected a number"),
        ([], {"KVSTORE_AUTH_TOKEN": "short"}, "at least 16 characters"),
    ],
)
def test_serve_refuses_bad_settings_with_one_line(
    argv: list[str], env: dict[str, str], match: str, capsys, monkeypatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvstore serve: error: ") and match in err[0], err
    assert err[1].startswith("hint:")


def test_serve_config_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    assert main(["serve", "--config", str(bad)]) == 1
    assert "unknown setting(s) in config file: prot" in capsys.readouterr().err
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tokens]]\ntoken = "short"\ntenant = "a"\n')
    assert main(["serve", "--tokens-file", str(tokens)]) == 1
    assert "at least 16 characters" in capsys.readouterr().err


def test_serve_settings_layer_file_env_flags(tmp_path) -> None:
    from kvstore.server.serve import load_configs

    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(
        '[node]\ndram_bytes = "128MiB"\npolicy = "fifo"\n'
        "[server]\nport = 7001\nmax_batch = 64\nallow_anonymous = true\n"
    )
    env = {"KVSTORE_PORT": "7002", "KVSTORE_POLICY": "s3fifo", "KVSTORE_LEASE_TTL_S": "2.5"}
    node, server = load_configs({"config": str(cfg), "max_batch": "32"}, env=env)
    assert node.dram_bytes == 128 << 20  # file
    assert node.policy == "s3fifo"  # env beats file
    assert server.port == 7002 and server.lease_ttl_s == 2.5  # env beats file
    assert server.max_batch == 32  # flag beats file
    assert server.allow_anonymous
