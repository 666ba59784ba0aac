"""Polling for a client's next request (kvstore/wire/polling.py).

Polling must never lose or reorder a byte of the stream. It must end when its window
passes, when the peer closes, and when another connection's request is handled. It
must stay off while clients interleave, and neither end polls for a peer in its own
process (each learns it from the handshake; there is no process-wide state, so every
object here is built with the state it needs). Against a real server: polling changes
no answer, single or concurrent clients, and ``data_poll_us 0`` turns it off; a server
in this process and its in-process client never poll, while a client in another
process is polled for.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client import StoreClient
from kvstore.client.transport.conn import DataConn
from kvstore.config import ClientConfig, NodeConfig, ServerConfig
from kvstore.errors import ConfigError
from kvstore.observe.counters import NodeCounters
from kvstore.server.serve import StoreServer
from kvstore.wire.frames import PROTOCOL, REPLY, FrameSocket, Op, frame
from kvstore.wire.locality import host_id
from kvstore.wire.polling import IdlePoller, same_process
from tests.support.frame_pair import frame_pair
from tests.support.server_process import ALPHA
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from tests.support.server_fixtures import ServerFactory

KiB = 1 << 10
ROOT = Path(__file__).resolve().parents[2]


def _poller(*args: Any, **kwargs: Any) -> IdlePoller:
    """An IdlePoller that ignores how crowded the host is: these tests are about its
    own rules, and a test run crowds a 2-core host."""
    return IdlePoller(*args, crowded=lambda: False, **kwargs)


# Not named ``pair``: tests/conftest.py marks tests using a fixture of that name as
# starting processes (tests/cluster's pair does); these sockets are all in this process.
@pytest.fixture
def sockets() -> Iterator[tuple[FrameSocket, socket.socket]]:
    """A server-side FrameSocket over loopback TCP and the raw socket of its client."""
    with frame_pair(server_side=True) as pair:
        yield pair


def _later(seconds: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()  # type: ignore[operator]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- FrameSocket.poll_next -------------------------------------------------------------


def test_a_frame_sent_while_polling_is_buffered_and_read_whole(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    t = _later(0.02, lambda: client.sendall(frame(Op.EXISTS, b"meta-bytes")))
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    t.join()
    assert fs.buffered > 0
    assert fs.recv_header() == (Op.EXISTS, len(b"meta-bytes"), 0)
    assert fs.recv_bytes(len(b"meta-bytes")) == b"meta-bytes"


def test_a_poll_that_times_out_loses_nothing_that_comes_later(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    deadline = time.monotonic() + 0.01
    assert not fs.poll_next(lambda: time.monotonic() < deadline)
    assert fs.buffered == 0
    client.sendall(frame(Op.MATCH, b"abc") + frame(Op.EXISTS, b"defg"))
    assert fs.recv_header() == (Op.MATCH, 3, 0)
    assert fs.recv_bytes(3) == b"abc"
    assert fs.recv_header() == (Op.EXISTS, 4, 0)
    assert fs.recv_bytes(4) == b"defg"


def test_a_poll_after_part_of_a_frame_keeps_the_order(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    whole = frame(Op.EXISTS, b"x" * 100)
    client.sendall(whole[:7])  # half a header
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    _later(0.01, lambda: client.sendall(whole[7:]))
    assert fs.recv_header() == (Op.EXISTS, 100, 0)
    assert fs.recv_bytes(100) == b"x" * 100


def test_a_peer_that_hangs_up_ends_the_poll_and_the_read_sees_eof(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    _later(0.01, client.close)
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    with pytest.raises(EOFError):
        fs.recv_header(idle=True)


# -- IdlePoller ------------------------------------------------------------------------


def test_a_lone_client_is_polled_for_and_counted(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    counters = NodeCounters()
    poller = _poller(0.5, counters)
    poller.served(1)
    _later(0.01, lambda: client.sendall(frame(Op.EXISTS, b"")))
    assert poller.wait(fs, 1)
    assert fs.recv_header() == (Op.EXISTS, 0, 0)
    poller.served(1)
    t0 = time.monotonic()
    assert not _poller(0.02, counters).wait(fs, 1)  # nothing comes: the window ends it
    assert time.monotonic() - t0 < 1.0
    assert counters.get("data_polls_caught") == 1
    assert counters.get("data_polls_missed") == 1


def test_a_window_of_zero_never_polls(sockets: tuple[FrameSocket, socket.socket]) -> None:
    fs, _ = sockets
    counters = NodeCounters()
    poller = _poller(0.0, counters)
    assert not poller.enabled
    assert not poller.wait(fs, 1)
    assert counters.snapshot() == {}


def test_another_connections_request_ends_a_poll(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, _ = sockets
    poller = _poller(10.0)
    poller.served(1)
    _later(0.02, lambda: poller.served(2))
    t0 = time.monotonic()
    assert not poller.wait(fs, 1)
    assert time.monotonic() - t0 < 5.0  # far short of the 10 s window


def test_one_poller_at_a_time(sockets: tuple[FrameSocket, socket.socket]) -> None:
    fs, client = sockets
    poller = _poller(10.0)
    poller.served(1)
    caught: list[bool] = []
    t = threading.Thread(target=lambda: caught.append(poller.wait(fs, 1)), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not poller.polling:  # the thread holds the slot (no sleep picks a moment)
        assert time.monotonic() < deadline, "the first waiter never started polling"
    assert not poller.wait(fs, 1)  # the slot is taken: returns at once
    client.sendall(frame(Op.EXISTS, b""))
    t.join(5)
    assert caught == [True]


def test_clients_taking_turns_fast_turn_polling_off_for_a_while(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = sockets
    poller = _poller(0.5, quiet_s=0.2)
    poller.served(1)
    poller.served(2)  # one change of client: a hand-over, polling stays on
    client.sendall(frame(Op.EXISTS, b""))
    assert poller.wait(fs, 2)
    fs.recv_header()
    poller.served(1)  # a second change within quiet_s: interleaving clients
    t0 = time.monotonic()
    assert not poller.wait(fs, 1)
    assert time.monotonic() - t0 < 0.4  # refused, not polled (polling lasts 0.5 s)
    time.sleep(0.25)  # quiet_s (a timer, the thing under test) later: polled for again
    client.sendall(frame(Op.EXISTS, b""))
    assert poller.wait(fs, 1)


def test_a_peer_is_in_this_process_only_with_this_host_and_pid() -> None:
    assert same_process(host_id(), os.getpid())
    assert not same_process(host_id(), os.getpid() + 1)
    assert not same_process("another-host", os.getpid())
    assert not same_process(host_id(), 0)  # a peer that sent no pid


def test_a_poller_its_owner_forbids_never_polls(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    """A server with a client of its own process connected: the poller would hold the
    GIL that client needs to send its next request."""
    fs, client = sockets
    allowed = [False]
    counters = NodeCounters()
    poller = _poller(5.0, counters, may_poll=lambda: allowed[0])
    poller.served(1)
    client.sendall(frame(Op.EXISTS, b""))
    assert select.select([fs.sock], [], [], 5.0)[0]  # the frame has arrived
    t0 = time.monotonic()
    assert not poller.wait(fs, 1)  # refused at once, though a frame is waiting
    assert time.monotonic() - t0 < 1.0
    assert counters.snapshot() == {}
    allowed[0] = True  # that client is gone
    assert poller.wait(fs, 1)


def test_the_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="data_poll_us"):
        ServerConfig(allow_anonymous=True, data_poll_us=-1)
    with pytest.raises(ConfigError, match="data_poll_us"):
        ServerConfig(allow_anonymous=True, data_poll_us=20_000)
    assert ServerConfig(allow_anonymous=True, data_poll_us=0).data_poll_us == 0


# -- the client's poll for a reply -------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.05])
def test_a_reply_is_read_whole_however_long_it_takes(
    sockets: tuple[FrameSocket, socket.socket], delay_s: float
) -> None:
    """Within the poll window, just past it and far past it: the same reply."""
    server_fs, client_sock = sockets
    conn = DataConn(FrameSocket(client_sock, max_meta=1 << 20), pb.InfoResponse())
    conn.poll_replies(0.001, threading.Lock())
    assert conn.reply_poll_s == 0.001

    def answer() -> None:
        op, meta_len, _ = server_fs.recv_header()
        assert op == Op.EXISTS
        server_fs.recv_bytes(meta_len)
        time.sleep(delay_s)
        reply = pb.ExistsResponse(present=[True, False]).SerializeToString()
        server_fs.send_raw(frame(Op.EXISTS | REPLY, reply))

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    got, body = conn.call(
        Op.EXISTS, pb.KeysRequest(keys=[b"k" * 16]), pb.ExistsResponse, time.monotonic() + 5
    )
    t.join(5)
    assert list(got.present) == [True, False] and body == 0


def test_a_client_does_not_poll_for_a_server_in_its_own_process(
    sockets: tuple[FrameSocket, socket.socket],
) -> None:
    _, client_sock = sockets
    fs = FrameSocket(client_sock, max_meta=1 << 20)
    here = DataConn(fs, pb.InfoResponse(host_id=host_id(), pid=os.getpid()))
    elsewhere = DataConn(fs, pb.InfoResponse(host_id=host_id(), pid=os.getpid() + 1))
    slot = threading.Lock()  # a pool's: one of its threads polls at a time
    here.poll_replies(0.005, slot)
    elsewhere.poll_replies(0.005, slot)
    assert here.server_in_process and here.reply_poll_s == 0
    assert not elsewhere.server_in_process and elsewhere.reply_poll_s == 0.005
    assert elsewhere.reply_slot is slot


def test_the_client_poll_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="reply_poll_us"):
        ClientConfig(reply_poll_us=-5)
    with pytest.raises(ConfigError, match="reply_poll_us"):
        ClientConfig(reply_poll_us=50_000)
    assert ClientConfig(reply_poll_us=0).reply_poll_us == 0


# -- against a real server -------------------------------------------------------------


def _values(n: int, size: int, salt: int) -> list[np.ndarray]:
    return [
        np.random.default_rng(salt * 1000 + i).integers(0, 255, size, np.uint8) for i in range(n)
    ]


def test_polling_serves_a_pipelined_client_and_counts_its_catches(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(data_poll_us=5000, data_poll_crowded=True)
    keys = [f"poll-seq-{i}".encode().ljust(16, b".") for i in range(8)]
    values = _values(8, 64 * KiB, 1)
    with server.client(ALPHA, transport="tcp") as c:
        c.batch_put(keys, values)
        for _ in range(5):
            for k, v in zip(keys, values, strict=True):
                got = c.get(k)
                assert got is not None and np.array_equal(got, v)
        counters = c.stats()["server"]
    assert counters.get("data_polls_caught", 0) >= 20  # back-to-back gets: most caught


def test_concurrent_clients_get_right_answers_with_polling_on(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(data_poll_us=5000)
    n_clients, rounds = 3, 40
    keys = [[f"poll-c{j}-{i}".encode().ljust(16, b".") for i in range(4)] for j in range(3)]
    values = [_values(4, 32 * KiB, 10 + j) for j in range(n_clients)]
    errors: list[str] = []

    def worker(j: int) -> None:
        try:
            with server.client(ALPHA, transport="tcp") as c:
                c.batch_put(keys[j], values[j])
                out = np.empty(32 * KiB, dtype=np.uint8)
                for r in range(rounds):
                    i = r % 4
                    if not c.get_into(keys[j][i], out) or not np.array_equal(out, values[j][i]):
                        errors.append(f"client {j} round {r}: wrong or missing bytes")
                    assert c.exists(keys[j]) == [True] * 4
        except Exception as exc:  # reported below, with the others
            errors.append(f"client {j}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_a_window_of_zero_turns_polling_off(server_factory: ServerFactory) -> None:
    server = server_factory(data_poll_us=0)
    key = b"poll-off-key-000"
    with server.client(ALPHA, transport="tcp", reply_poll_us=0) as c:
        c.put(key, np.arange(4096, dtype=np.uint8))
        for _ in range(10):
            assert c.get(key) is not None
        counters = c.stats()["server"]
    assert "data_polls_caught" not in counters and "data_polls_missed" not in counters


# -- a server in this process ------------------------------------------------------------


@contextmanager
def _server_here(**config: object) -> Iterator[StoreServer]:
    """A StoreServer in this process, its event loop on a thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    srv = StoreServer(
        NodeConfig(dram_bytes=8 << 20, warm=False),
        ServerConfig(port=0, data_port=0, allow_anonymous=True, **config),  # type: ignore[arg-type]
    )
    try:
        asyncio.run_coroutine_threadsafe(srv.start(), loop).result(30)
        yield srv
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _in_process_clients(srv: StoreServer) -> int:
    assert srv._data is not None
    return srv._data.in_process_clients


def _polls(srv: StoreServer) -> tuple[int, int]:
    assert srv._gateway is not None
    counters = srv._gateway.books.counters
    return counters.get("data_polls_caught"), counters.get("data_polls_missed")


def _raw_gets(srv: StoreServer, pid: int, n: int) -> None:
    """A hand-made data connection claiming ``pid``: HELLO, then ``n`` EXISTS."""
    with socket.create_connection(("127.0.0.1", srv.data_port), timeout=5) as sock:
        fs = FrameSocket(sock, max_meta=1 << 20)
        fs.set_timeout(5)
        hello = pb.Hello(protocol=PROTOCOL, pid=pid, host_id=host_id())
        fs.send(Op.HELLO, hello.SerializeToString())
        op, meta_len, _ = fs.recv_header()
        assert op == Op.INFO
        info = pb.InfoResponse.FromString(fs.recv_bytes(meta_len))
        assert info.pid == os.getpid() and info.host_id == host_id()
        assert _in_process_clients(srv) == (1 if pid == os.getpid() else 0)
        req = pb.KeysRequest(keys=[b"k" * 16]).SerializeToString()
        for _ in range(n):
            fs.send(Op.EXISTS, req)
            op, meta_len, _ = fs.recv_header()
            assert op == Op.EXISTS | REPLY
            fs.recv_bytes(meta_len)


def test_the_server_polls_only_for_clients_of_other_processes() -> None:
    """Hermetic: a connection saying HELLO with this pid stops polling while it is
    open; one claiming another pid is polled for."""
    with _server_here(data_poll_us=5000, data_poll_crowded=True) as srv:
        _raw_gets(srv, os.getpid(), 20)
        assert _polls(srv) == (0, 0)
        wait_until(lambda: _in_process_clients(srv) == 0, "in-process connection counted out")
        _raw_gets(srv, os.getpid() + 1, 20)
        caught, missed = _polls(srv)
        assert caught + missed >= 10


_REMOTE_CLIENT = """
import sys
import numpy as np
from kvstore.client import StoreClient

keys = [f"remote-{i}".encode().ljust(16, b".") for i in range(8)]
value = np.arange(16 * 1024, dtype=np.uint8)
with StoreClient.connect(sys.argv[1], transport="tcp", timeout_s=10) as c:
    c.batch_put(keys, [value] * len(keys))
    for _ in range(5):
        for k in keys:
            assert c.get(k) is not None
"""


@pytest.mark.process
def test_an_in_process_pair_never_polls_and_a_client_elsewhere_is_polled_for() -> None:
    with _server_here(data_poll_us=5000, data_poll_crowded=True) as srv:
        keys = [f"local-{i}".encode().ljust(16, b".") for i in range(8)]
        values = _values(8, 16 * KiB, 3)
        address = f"127.0.0.1:{srv.port}"
        with StoreClient.connect(address, transport="tcp", reply_poll_us=2000) as c:
            c.batch_put(keys, values)
            for _ in range(5):
                for k, v in zip(keys, values, strict=True):
                    got = c.get(k)
                    assert got is not None and np.array_equal(got, v)
            assert _in_process_clients(srv) >= 1
        assert _polls(srv) == (0, 0)  # that client's connections: never polled for
        wait_until(lambda: _in_process_clients(srv) == 0, "in-process connections counted out")
        subprocess.run(
            [sys.executable, "-c", _REMOTE_CLIENT, address], cwd=ROOT, check=True, timeout=60
        )
        caught, missed = _polls(srv)
        assert caught + missed >= 20  # one poll after each of its 40+ replies, or so
        assert caught > 0
