"""The gRPC control plane called directly, request limits, and ``kvstore serve`` settings.

The control plane carries no get or put: blocks here are written and read through the
data socket (StoreClient, or a raw frame where a test must skip the client's checks).
The handlers' answers are checked again through a client's control channel on the
in-memory network (tests/support/memory_fixtures.py), in the hermetic run.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import xxhash

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.cli import main
from kvstore.errors import BlockTooLarge, LimitExceeded
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.grpc_errors import error_from_rpc
from tests.support.memory_fixtures import MemoryFactory, MemoryStore
from tests.support.server_process import ADMIN, ALPHA, ServerProcess

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


def test_control_calls_see_what_the_data_socket_stored(
    stub: pb_grpc.StoreStub, store_server: ServerProcess
) -> None:
    keys = [b"grpc-control-ke" + bytes([i]) for i in range(3)]
    with store_server.client(ALPHA, transport="tcp") as c:
        assert c.batch_put(keys[:2], [b"hello", b"world"]) == [True, True]
        assert c.get(keys[0]) == b"hello" and c.get(keys[2]) is None
    req = pb.KeysRequest(keys=keys)
    assert list(stub.Exists(req, metadata=MD).present) == [True, True, False]
    assert list(stub.Lookup(req, metadata=MD).tier) == ["dram", "dram", ""]
    assert stub.MatchPrefix(req, metadata=MD).matched == 2
    assert stub.Remove(req, metadata=MD).removed == 2
    assert list(stub.Exists(req, metadata=MD).present) == [False, False, False]


def test_a_put_whose_payload_fails_its_checksum_is_refused(store_server: ServerProcess) -> None:
    key = b"corrupt-put-key."
    with store_server.client(ALPHA, transport="tcp") as c:
        res = _raw_put(c, key, 4096, checksum_flip=1).results[0]
        assert not res.stored and res.error.code == "corrupt_block"
        assert c.exists([key]) == [False]  # nothing visible, and the connection in step
        assert c.put(key, np.full(4096, 3, dtype=np.uint8))  # the key was left free
        assert (c.get(key) == 3).all()


def test_stats_shape(stub: pb_grpc.StoreStub) -> None:
    stats = stub.Stats(pb.StatsRequest(), metadata=MD)
    assert {t.tier for t in stats.tiers} == {"dram", "ssd"}
    assert "connections" in stats.server and "leases" in stats.server


def test_limits(server_factory) -> None:
    server = server_factory(max_batch=8, max_value_bytes="64KiB", max_message_bytes="1MiB")
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.StoreStub(channel)
    try:
        nine = [bytes([i]) * 16 for i in range(9)]
        with pytest.raises(grpc.RpcError) as e:
            stub.Exists(pb.KeysRequest(keys=nine), metadata=MD)
        assert isinstance(error_from_rpc(e.value), LimitExceeded)
        with pytest.raises(grpc.RpcError) as e:  # over max_message_bytes (gRPC's own check)
            big = pb.PutRequest(items=[_item(b"m" * 16, b"x" * (2 << 20))])
            stub.Import(big, metadata=bearer_metadata(ADMIN.token))
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


# -- the same handlers through a client's control channel, on the in-memory network ------


def test_info_and_health_through_the_client(memory_server: MemoryStore) -> None:
    with memory_server.client(ALPHA) as c, memory_server.client(ADMIN) as admin:
        info = c.server_info
        assert info["tenant"] == "alpha" and not info.get("admin", False)
        assert info["tiers"] == ["dram", "ssd"] and admin.server_info["admin"] is True
        assert c.health() == "serving"
        health = c.control("Health", pb.HealthRequest())
        assert health.instance_id == info["instance_id"]


def test_control_calls_see_what_the_data_path_stored(memory_server: MemoryStore) -> None:
    keys = [b"mem-control-key" + bytes([i]) for i in range(3)]
    with memory_server.client(ALPHA) as c:
        assert c.batch_put(keys[:2], [b"hello", b"world"]) == [True, True]
        assert c.get(keys[0]) == b"hello" and c.get(keys[2]) is None
        req = pb.KeysRequest(keys=keys)
        assert list(c.control("Exists", req).present) == [True, True, False]
        assert list(c.control("Lookup", req).tier) == ["dram", "dram", ""]
        assert c.control("MatchPrefix", req).matched == 2
        assert c.control("Remove", req).removed == 2
        assert list(c.control("Exists", req).present) == [False, False, False]
        stats = c.control("Stats", pb.StatsRequest())
        assert {t.tier for t in stats.tiers} == {"dram", "ssd"}


def test_limits_said_by_the_server_bind_client_and_control_calls(
    memory_factory: MemoryFactory,
) -> None:
    server = memory_factory(max_batch=8, max_value_bytes="64KiB", max_message_bytes="1MiB")
    nine = [bytes([i]) * 16 for i in range(9)]
    with server.client(ALPHA) as c:
        with pytest.raises(LimitExceeded, match="max_batch"):
            c.exists(nine)  # the client's own check, from the limits Info said
        with pytest.raises(LimitExceeded):
            c.control("Exists", pb.KeysRequest(keys=nine))  # the servicer's
        with pytest.raises(BlockTooLarge):
            c.put(b"v" * 16, np.zeros(128 << 10, dtype=np.uint8))
        assert c.exists(nine[:8]) == [False] * 8


def _raw_put(client, key: bytes, n: int, checksum_flip: int = 0) -> pb.PutResponse:
    """A PUT frame that skips the client's own checks (size; ``checksum_flip`` != 0: a
    checksum that does not match the payload)."""
    import time

    from kvstore.wire.frames import Op

    payload = np.zeros(n, dtype=np.uint8)
    checksum = xxhash.xxh3_64_intdigest(payload) ^ checksum_flip
    req = pb.PutRequest(items=[pb.PutItem(key=key, meta=_meta(n), checksum=checksum)])
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
