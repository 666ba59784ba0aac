"""Authentication, tenant isolation, admin rights and TLS, against real servers; the
tests whose subject is the server's logic, not its sockets, also run on the in-memory
network (tests/support/memory_fixtures.py), in the hermetic run."""

from __future__ import annotations

import socket
import time
from typing import TypeVar

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.message import Message
from xxhash import xxh3_64_intdigest

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.admin import AdminClient
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.shm import Segment
from kvstore.errors import AuthError, KVStoreError, PermissionDenied, TransportError, Unavailable
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.frames import PROTOCOL, FrameSocket, Op
from tests.support.memory_fixtures import Served, over, reach, serving
from tests.support.server_process import ADMIN, ALPHA, BRAVO, ServerProcess, make_tls_cert
from tests.support.waiting import wait_until

NS = Namespace("llama-3-8b", "bf16:L2:H2:D8")
ALL_RPCS = [
    ("Info", pb.InfoRequest()),
    ("Health", pb.HealthRequest()),
    ("Exists", pb.KeysRequest(keys=[b"k" * 16])),
    ("MatchPrefix", pb.KeysRequest(keys=[b"k" * 16])),
    ("Lookup", pb.KeysRequest(keys=[b"k" * 16])),
    ("Remove", pb.KeysRequest(keys=[b"k" * 16])),
    ("Stats", pb.StatsRequest()),
    ("Evict", pb.EvictRequest(tier="dram")),
    ("Drain", pb.DrainRequest()),
    ("Scan", pb.ScanRequest(limit=1)),
    ("Export", pb.KeysRequest(keys=[b"k" * 16])),
    ("Import", pb.PutRequest()),
    ("Purge", pb.KeysRequest(keys=[b"k" * 16])),
]

M = TypeVar("M", bound=Message)  # a reply message type


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
    service = pb.DESCRIPTOR.services_by_name["Store"]
    assert sorted(name for name, _ in ALL_RPCS) == sorted(service.methods_by_name)
    for name, request in ALL_RPCS:
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, name)(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert ("kvstore-error-code", "unauthenticated") in info.value.trailing_metadata()


def test_client_maps_refused_tokens_to_auth_error(any_server: Served) -> None:
    for token in (None, "wrong-token-0123456789"):
        with pytest.raises(AuthError):
            StoreClient.connect(
                any_server.address, token=token, connect_timeout_s=5, **reach(any_server)
            )


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


@pytest.mark.parametrize(("kind", "transport"), over("shm", "tcp"))
def test_tenants_never_see_each_others_blocks(
    request: pytest.FixtureRequest, kind: str, transport: str
) -> None:
    # Same prompt, same namespace, same client keys: different tenants, different blocks.
    server = serving(request, kind)
    keys = prefix_keys(
        [len(transport) * 100 + ord(transport[:1] or "m") + i for i in range(8)], 4, NS
    )
    alpha = server.client(ALPHA, transport=transport, namespace=NS)
    bravo = server.client(BRAVO, transport=transport, namespace=NS)
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


def test_a_tenant_cannot_end_another_tenants_lease(store_server: ServerProcess) -> None:
    """Leases are granted on the data socket to a tenant: another tenant's COMMIT, ABORT
    or RELEASE of its lease id does nothing; its owner's ends it."""
    key, payload = b"lease-tenant-key", np.arange(64, dtype=np.uint8)
    deadline = time.monotonic() + 10
    target = ("127.0.0.1", store_server.data_port)
    alpha = DataConn.open(target, ALPHA.token, deadline=deadline)
    bravo = DataConn.open(target, BRAVO.token, deadline=deadline)
    observer = store_server.client(ALPHA, transport="tcp")
    seg = Segment(alpha.info.shm_name, alpha.info.shm_size)

    def leases() -> int:
        return int(observer.stats()["server"]["leases"])

    def call(conn: DataConn, op: Op, req: Message, reply: type[M]) -> M:
        return conn.call(op, req, reply, deadline)[0]

    def settle(conn: DataConn) -> None:  # deferred RELEASEs go out before this request
        call(conn, Op.EXISTS, pb.KeysRequest(keys=[key]), pb.ExistsResponse)

    try:
        wait_until(lambda: leases() == 0, "the module's earlier leases to end")
        # A write lease: bravo can neither commit nor abort it; alpha commits it.
        meta = pb.ValueMeta(dtype="uint8", shape=[64], kind=0, nbytes=64)
        reserve = pb.PutRequest(items=[pb.PutItem(key=key, meta=meta)])
        res = call(alpha, Op.RESERVE, reserve, pb.PutResponse).results[0]
        assert res.lease_id and res.offset >= 0
        seg.extent(res.offset, 64)[:] = payload
        commit = pb.CommitRequest(
            items=[pb.CommitItem(lease_id=res.lease_id, checksum=xxh3_64_intdigest(payload))]
        )
        stolen = call(bravo, Op.COMMIT, commit, pb.PutResponse).results[0]
        assert not stolen.stored and stolen.error.code == "reservation"
        abort = pb.LeaseRequest(lease_ids=[res.lease_id])
        aborted = call(bravo, Op.ABORT, abort, pb.LeaseResponse)
        assert (aborted.released, aborted.expired) == (0, 1)
        assert leases() == 1
        assert call(alpha, Op.COMMIT, commit, pb.PutResponse).results[0].stored
        assert observer.get(key) == payload.tobytes()

        # A read lease: bravo's RELEASE, and alpha's ABORT (a read is no write), leave it
        # pinned; alpha's RELEASE ends it.
        opened = call(alpha, Op.LEASE, pb.GetRequest(keys=[key]), pb.GetResponse)
        lease = opened.blocks[0].lease_id
        assert lease and opened.blocks[0].offset >= 0 and leases() == 1
        bravo.defer_release([lease])
        settle(bravo)
        assert leases() == 1
        wrong_kind = pb.LeaseRequest(lease_ids=[lease])
        assert call(alpha, Op.ABORT, wrong_kind, pb.LeaseResponse).released == 0
        assert leases() == 1
        alpha.defer_release([lease])
        settle(alpha)
        assert leases() == 0
    finally:
        seg.close()
        observer.close()
        alpha.close()
        bravo.close()


def test_admin_operations_need_an_admin_token(any_server: Served) -> None:
    with any_server.client(ALPHA) as c:
        with pytest.raises(PermissionDenied):
            AdminClient(c).evict("dram", 0)
        with pytest.raises(PermissionDenied):
            c.set_draining(True)
    with any_server.client(ADMIN) as admin, any_server.client(ALPHA) as c:
        assert admin.set_draining(True) is True
        try:
            assert c.health() == "draining"
            with pytest.raises(Unavailable, match="draining"):
                c.put(b"drain-test-key..", b"x", timeout=1)
            assert c.exists([b"drain-test-key.."]) == [False]  # reads keep working
        finally:
            assert admin.set_draining(False) is False
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
