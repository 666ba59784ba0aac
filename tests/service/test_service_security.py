"""Authentication, tenant isolation, admin rights and TLS, against real servers."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.admin import AdminClient
from kvstore.errors import AuthError, KVStoreError, PermissionDenied, TransportError, Unavailable
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.frames import PROTOCOL, FrameSocket, Op
from tests.support.server_process import ADMIN, ALPHA, BRAVO, ServerProcess, make_tls_cert

NS = Namespace("llama-3-8b", "bf16:L2:H2:D8")
ALL_RPCS = [
    ("Info", pb.InfoRequest()),
    ("Health", pb.HealthRequest()),
    ("Exists", pb.KeysRequest(keys=[b"k" * 16])),
    ("MatchPrefix", pb.KeysRequest(keys=[b"k" * 16])),
    ("Lookup", pb.KeysRequest(keys=[b"k" * 16])),
    ("Remove", pb.KeysRequest(keys=[b"k" * 16])),
    ("Get", pb.GetRequest(keys=[b"k" * 16])),
    ("Put", pb.PutRequest()),
    ("Reserve", pb.PutRequest()),
    ("Commit", pb.CommitRequest()),
    ("Abort", pb.LeaseRequest()),
    ("OpenRead", pb.GetRequest()),
    ("CloseRead", pb.LeaseRequest()),
    ("Stats", pb.StatsRequest()),
    ("Evict", pb.EvictRequest(tier="dram")),
    ("Drain", pb.DrainRequest()),
]


def _block(seed: float) -> torch.Tensor:
    return torch.full((2, 2, 2, 4, 8), seed, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def stub(store_server: ServerProcess) -> pb_grpc.StoreStub:
    channel = grpc.insecure_channel(store_server.address)
    yield pb_grpc.StoreStub(channel)
    channel.close()


@pytest.mark.parametrize(
    "metadata",
    [(), bearer_metadata("wrong-token-0123456789"), (("authorization", "Basic dXNlcjpwYXNz"),)],
    ids=["missing", "wrong", "not-bearer"],
)
def test_every_rpc_needs_a_valid_token(stub: pb_grpc.StoreStub, metadata: tuple) -> None:
    for name, request in ALL_RPCS:
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, name)(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert ("kvstore-error-code", "unauthenticated") in info.value.trailing_metadata()


def test_client_maps_refused_tokens_to_auth_error(store_server: ServerProcess) -> None:
    for token in (None, "wrong-token-0123456789"):
        with pytest.raises(AuthError):
            StoreClient.connect(store_server.address, token=token, connect_timeout_s=5)


def _hello(server: ServerProcess, token: str) -> FrameSocket:
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=5)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(5)
    fs.send(Op.HELLO, pb.Hello(token=token, protocol=PROTOCOL).SerializeToString())
    return fs


@pytest.mark.parametrize("token", ["", "wrong-token-0123456789"])
def test_data_socket_refuses_bad_tokens(store_server: ServerProcess, token: str) -> None:
    fs = _hello(store_server, token)
    op, meta_len, _ = fs.recv_header()
    assert op == Op.ERROR
    status = pb.Status.FromString(fs.recv_bytes(meta_len))
    assert status.code == "unauthenticated"
    with pytest.raises(EOFError):  # and the server hangs up
        fs.recv_header()
    fs.close()


def test_data_socket_requires_hello_first(store_server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", store_server.data_port), timeout=5)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(5)
    fs.send(Op.EXISTS, pb.KeysRequest(keys=[b"k" * 16]).SerializeToString())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.ERROR and "HELLO" in pb.Status.FromString(fs.recv_bytes(meta_len)).message
    fs.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tenants_never_see_each_others_blocks(store_server: ServerProcess, transport: str) -> None:
    # Same prompt, same namespace, same client keys: different tenants, different blocks.
    keys = prefix_keys([len(transport) * 100 + ord(transport[0]) + i for i in range(8)], 4, NS)
    alpha = store_server.client(ALPHA, transport=transport, namespace=NS)
    bravo = store_server.client(BRAVO, transport=transport, namespace=NS)
    with alpha, bravo:
        assert alpha.batch_put(keys, [_block(1), _block(2)]) == [True, True]
        assert bravo.exists(keys) == [False, False]
        assert bravo.match_prefix(keys) == 0
        assert bravo.get(keys[0]) is None
        assert bravo.get_into(keys[0], _block(0)) is False
        assert bravo.remove(keys) == 0
        assert bravo.put(keys[0], _block(9)) is True  # its own block under the same key
        assert torch.equal(alpha.get(keys[0]), _block(1))
        assert torch.equal(bravo.get(keys[0]), _block(9))
        assert bravo.remove(keys) == 1
        assert alpha.match_prefix(keys) == 2


def test_a_tenant_cannot_end_another_tenants_lease(stub: pb_grpc.StoreStub) -> None:
    key = b"lease-tenant-key"
    alpha, bravo = bearer_metadata(ALPHA.token), bearer_metadata(BRAVO.token)
    stub.Put(_inline_put(key, b"x" * 64), metadata=alpha)
    opened = stub.OpenRead(pb.GetRequest(keys=[key]), metadata=alpha)
    lease = opened.blocks[0].lease_id
    assert lease and opened.blocks[0].offset >= 0
    assert stub.CloseRead(pb.LeaseRequest(lease_ids=[lease]), metadata=bravo).released == 0
    assert stub.Abort(pb.LeaseRequest(lease_ids=[lease]), metadata=alpha).released == 0
    assert stub.CloseRead(pb.LeaseRequest(lease_ids=[lease]), metadata=alpha).released == 1


def _inline_put(key: bytes, payload: bytes) -> pb.PutRequest:
    import xxhash

    meta = pb.ValueMeta(dtype="uint8", shape=[len(payload)], kind=0, nbytes=len(payload))
    item = pb.PutItem(
        key=key, meta=meta, checksum=xxhash.xxh3_64_intdigest(payload), payload=payload
    )
    return pb.PutRequest(items=[item])


def test_admin_operations_need_an_admin_token(store_server: ServerProcess) -> None:
    with store_server.client(ALPHA) as c:
        with pytest.raises(PermissionDenied):
            AdminClient(c).evict("dram", 0)
        with pytest.raises(PermissionDenied):
            c.drain(True)
    with store_server.client(ADMIN) as admin, store_server.client(ALPHA) as c:
        assert admin.drain(True) is True
        try:
            assert c.health() == "draining"
            with pytest.raises(Unavailable, match="draining"):
                c.put(b"drain-test-key..", b"x", timeout=1)
            assert c.exists([b"drain-test-key.."]) == [False]  # reads keep working
        finally:
            assert admin.drain(False) is False
        assert c.put(b"drain-test-key..", b"x") is True


def test_tls(server_factory, tmp_path) -> None:
    cert, key = make_tls_cert(tmp_path)
    server = server_factory(tls_cert=cert, tls_key=key)
    for transport in ("shm", "tcp"):
        with server.client(ALPHA, transport=transport, tls_ca=str(cert)) as c:
            assert c.put(b"tls-key-" + transport.encode().ljust(8, b"."), _block(3)) is True
            assert torch.equal(c.get(b"tls-key-" + transport.encode().ljust(8, b".")), _block(3))
            assert c.transport == transport
    # A plaintext client, or one that does not trust the certificate, gets nowhere.
    with pytest.raises(KVStoreError):
        server.client(ALPHA, connect_timeout_s=1.0)
    with pytest.raises(KVStoreError):
        server.client(ALPHA, tls=True, connect_timeout_s=1.0)
    # Nor does a plaintext data socket.
    fs = _hello(server, ALPHA.token)
    with pytest.raises((EOFError, TransportError)):
        fs.recv_header()
    fs.close()
