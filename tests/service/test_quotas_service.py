"""Per-tenant quotas and stalled puts against a real ``kvstore serve`` (issue 17, attack
3): a tenant dribbling puts a byte a second holds its reservations for seconds, and
only as many as its quota allows, while another tenant's puts keep succeeding; and a
tenant at its DRAM quota demotes its own blocks, never another tenant's. The quota
logic (not the dribbling socket) runs on the in-memory network too, in the hermetic
run (tests/support/memory_fixtures.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import checksum, describe
from kvstore.errors import KVStoreError, QuotaExceeded
from kvstore.keys import Namespace, prefix_keys
from kvstore.wire.codec import error_of, meta_of
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, FrameSocket, Op
from tests.support.memory_fixtures import Served
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ADMIN, ALPHA, BRAVO, ServerProcess, write_tokens
from tests.support.waiting import wait_until

MODEL, LAYOUT = "m", "float32:L1:H1:D128:B64"
VALUE = np.ones((1, 2, 1, 64, 128), dtype=np.float32)  # 64 KiB, one block of LAYOUT
A_NS, B_NS = Namespace(MODEL, LAYOUT, ALPHA.tenant), Namespace(MODEL, LAYOUT, BRAVO.tenant)


def _tokens_with_quotas(workdir: Path, quotas: str) -> Path:
    path = write_tokens(workdir / "quota-tokens.toml")
    path.write_text(path.read_text() + "\n" + quotas)
    return path


def _start(factory: Callable[..., Served], tmp_path: Path, quotas: str, **flags: object) -> Served:
    tokens = _tokens_with_quotas(tmp_path, quotas)
    return factory(tokens_file=tokens, dram_bytes="1MiB", **flags)


def _dribbler(server: ServerProcess, key: bytes) -> socket.socket:
    """A raw data connection of tenant A that authenticates, then starts a PUT of one
    64 KiB block and sends only its first payload byte."""
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(10)
    fs.send(Op.HELLO, pb.Hello(token=ALPHA.token, protocol=PROTOCOL).SerializeToString())
    op, meta_len, _ = fs.recv_header()
    assert op == Op.INFO
    fs.recv_bytes(meta_len)
    item = pb.PutItem(key=key, meta=meta_of(describe(VALUE)), checksum=checksum(VALUE))
    req = pb.PutRequest(scope=pb.Scope(model=MODEL, layout=LAYOUT), items=[item])
    meta = req.SerializeToString()
    sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), VALUE.nbytes) + meta + b"\x01")
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""  # an ERROR frame may come first: not yet EOF
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


@pytest.mark.process
def test_a_dribbling_tenant_holds_little_for_short_while_another_puts(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = _start(
        server_factory,
        tmp_path,
        '[quotas.alpha]\nreservations = 2\ndram = "512KiB"\n',
        put_grace_s=1,
        put_floor_bytes="64KiB",  # a 64 KiB payload may take 1 + 1 s
    )
    assert isinstance(server, ServerProcess)
    a_keys = list(prefix_keys(list(range(20 * 64)), 64, A_NS))
    b_keys = list(prefix_keys(list(range(200 * 64)), 64, B_NS))
    t0 = time.monotonic()
    socks = [_dribbler(server, k) for k in a_keys]  # 20 x 64 KiB: more than DRAM holds
    stop = threading.Event()

    def dribble() -> None:  # one byte a second on every connection still open
        while not stop.wait(1.0):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"\x01", socket.MSG_DONTWAIT)

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    ok = tried = 0
    admin = server.client(ADMIN, transport="tcp")
    try:
        with server.client(BRAVO, namespace=B_NS, transport="tcp") as b:
            wait_until(
                lambda: admin.stats()["server"].get("quota_inflight@alpha") == 2,
                "A's two reservations",
            )
            held_at = time.monotonic()
            inflight = 2
            for key in b_keys[:40]:  # B writes 2.5 MiB meanwhile, through a 1 MiB DRAM
                tried += 1
                ok += bool(b.put(key, VALUE))
                inflight = max(inflight, admin.stats()["server"]["quota_inflight@alpha"])
                time.sleep(0.05)
            assert inflight <= 2, "A held more reservations than its quota"
            wait_until(
                lambda: admin.stats()["server"]["quota_inflight@alpha"] == 0,
                "A's reservations released",
                within=5,
            )
            released_s = time.monotonic() - t0
            server_stats = admin.stats()["server"]
        cut = sum(_closed_by_server(s) for s in socks)
    finally:
        stop.set()
        t.join(5)
        admin.close()
        for s in socks:
            s.close()
    print(
        f"B's puts: {ok}/{tried} stored while A dribbled; A's reservations released "
        f"{released_s:.1f} s after its puts began ({time.monotonic() - held_at:.1f} s "
        f"since seen held); {server_stats['quota_refusals@alpha']} of A's puts refused, "
        f"{server_stats['puts_stalled@alpha']} cut"
    )
    assert ok == tried, f"B stored {ok} of {tried}"
    assert released_s < 1 + 1 + 0.25 + 2.0, f"A held space {released_s:.1f} s"  # + slack
    assert server_stats["puts_stalled@alpha"] == 2
    assert server_stats["quota_refusals@alpha"] == 18
    assert cut >= 2  # the stalled ones were cut; the refused ones wait out io_timeout_s


def test_a_tenant_at_its_dram_quota_cannot_push_another_out(
    any_factory: Callable[..., Served], tmp_path: Path
) -> None:
    server = _start(any_factory, tmp_path, '[quotas.alpha]\ndram = "256KiB"\n')
    b_keys = list(prefix_keys(list(range(8 * 64)), 64, B_NS))
    a_keys = list(prefix_keys(list(range(40 * 64)), 64, A_NS))
    with (
        server.client(BRAVO, namespace=B_NS) as b,
        server.client(ALPHA, namespace=A_NS) as a,
    ):
        for k in b_keys:  # 512 KiB of B's in a 1 MiB DRAM
            assert b.put(k, VALUE)
        for k in a_keys:  # 2.5 MiB of A's, with a 256 KiB DRAM quota
            assert a.put(k, VALUE)
        tiers = b.control("Lookup", pb.KeysRequest(keys=b_keys)).tier
        assert list(tiers) == ["dram"] * len(b_keys), "A pushed B out of DRAM"
        a_tiers = list(a.control("Lookup", pb.KeysRequest(keys=a_keys)).tier)
        assert a_tiers[-3:] == ["dram"] * 3 and set(a_tiers[:-4]) == {"ssd"}
        used = a.stats()["server"]["quota_used_dram@alpha"]
        assert 0 < used <= 256 << 10
        assert "quota_used_dram@bravo" not in a.stats()["server"]  # its own only
        got = a.get(a_keys[0])  # its oldest, on SSD, still readable (promoted in turn)
        assert got is not None and np.array_equal(got, VALUE)
        assert a.stats()["server"]["quota_used_dram@alpha"] <= 256 << 10


def test_a_block_bigger_than_the_quota_is_refused_with_the_code(
    any_factory: Callable[..., Served], tmp_path: Path
) -> None:
    server = _start(any_factory, tmp_path, '[quotas.alpha]\ndram = "32KiB"\n')
    with server.client(ALPHA, namespace=A_NS) as a:
        with pytest.raises(QuotaExceeded, match="exceeds its dram quota"):
            a.put(b"q" * 16, VALUE)
        with server.client(BRAVO, namespace=B_NS) as b:
            assert b.put(b"q" * 16, VALUE)  # B has no quota


@pytest.mark.process
def test_a_bad_quota_stops_the_server_at_start(tmp_path: Path) -> None:
    tokens = _tokens_with_quotas(tmp_path, '[quotas.alpha]\ndram = "lots"\n')
    server = ServerProcess(tmp_path, {"port": 0, "data_port": 0, "tokens_file": tokens})
    with pytest.raises(RuntimeError, match=r"quotas.alpha.dram: cannot parse size"):
        server.start()


def _hello(server: ServerProcess, token: str) -> tuple[socket.socket, KVStoreError | None]:
    """A raw data connection's HELLO: the socket and the server's refusal, if any."""
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
    fs = FrameSocket(sock, max_meta=1 << 20)
    fs.set_timeout(10)
    fs.send(Op.HELLO, pb.Hello(token=token, protocol=PROTOCOL).SerializeToString())
    op, meta_len, _ = fs.recv_header()
    meta = fs.recv_bytes(meta_len)
    if op == Op.INFO:
        return sock, None
    assert op == Op.ERROR
    return sock, error_of(parse_status(meta))


def parse_status(meta: bytes) -> pb.Status:
    status = pb.Status()
    status.ParseFromString(meta)
    return status


@pytest.mark.process
def test_a_tenant_holds_at_most_its_quota_of_data_connections(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = _start(server_factory, tmp_path, "[quotas.alpha]\nconnections = 2\n")
    assert isinstance(server, ServerProcess)
    held = [_hello(server, ALPHA.token) for _ in range(2)]
    assert [err for _, err in held] == [None, None]
    sock, err = _hello(server, ALPHA.token)
    assert isinstance(err, QuotaExceeded) and "connections = 2" in str(err)
    wait_until(lambda: _closed_by_server(sock), "the refused connection closed", within=5)
    sock.close()
    others = [_hello(server, BRAVO.token) for _ in range(4)]  # no limit of its own
    assert [err for _, err in others] == [None] * 4
    held[0][0].close()  # a slot freed is taken again once the server saw the close

    def admitted() -> bool:
        s, e = _hello(server, ALPHA.token)
        held.append((s, e))
        return e is None

    wait_until(admitted, "alpha's next connection admitted", within=5)
    with server.client(ADMIN) as admin:  # tenant-tagged counters: an admin's to see
        assert admin.stats()["server"]["connections_refused@alpha"] >= 1
    for s, _ in held[1:] + others:
        s.close()
