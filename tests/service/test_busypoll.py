"""Polling for a client's next request (kvstore/wire/polling.py).

Polling must never lose or reorder a byte of the stream. It must end when its window
passes, when the peer closes, and when another connection's request is handled. It
must stay off while clients interleave. Against a real server: polling changes no
answer, single or concurrent clients, and ``data_poll_us 0`` turns it off.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.conn import DataConn
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import ConfigError
from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import REPLY, FrameSocket, Op, frame
from kvstore.wire.polling import PRESENCE, IdlePoller, Presence
from tests.support.server_process import ALPHA

if TYPE_CHECKING:
    from tests.support.server_fixtures import ServerFactory


KiB = 1 << 10


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test process also runs clients (and in-process servers elsewhere in the
    suite): each test here starts as a process that runs neither."""
    monkeypatch.setattr(PRESENCE, "clients", False)
    monkeypatch.setattr(PRESENCE, "servers", 0)


@pytest.fixture
def pair() -> Iterator[tuple[FrameSocket, socket.socket]]:
    """A server-side FrameSocket over loopback TCP and the raw socket of its client."""
    ls = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(ls.getsockname())
    server, _ = ls.accept()
    ls.close()
    fs = FrameSocket(server, max_meta=1 << 20)
    fs.set_timeout(5)
    try:
        yield fs, client
    finally:
        fs.close()
        client.close()


def _later(seconds: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()  # type: ignore[operator]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- FrameSocket.poll_next -------------------------------------------------------------


def test_a_frame_sent_while_polling_is_buffered_and_read_whole(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    t = _later(0.02, lambda: client.sendall(frame(Op.EXISTS, b"meta-bytes")))
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    t.join()
    assert fs.buffered > 0
    assert fs.recv_header() == (Op.EXISTS, len(b"meta-bytes"), 0)
    assert fs.recv_bytes(len(b"meta-bytes")) == b"meta-bytes"


def test_a_poll_that_times_out_loses_nothing_that_comes_later(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    deadline = time.monotonic() + 0.01
    assert not fs.poll_next(lambda: time.monotonic() < deadline)
    assert fs.buffered == 0
    client.sendall(frame(Op.MATCH, b"abc") + frame(Op.EXISTS, b"defg"))
    assert fs.recv_header() == (Op.MATCH, 3, 0)
    assert fs.recv_bytes(3) == b"abc"
    assert fs.recv_header() == (Op.EXISTS, 4, 0)
    assert fs.recv_bytes(4) == b"defg"


def test_a_poll_after_part_of_a_frame_keeps_the_order(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    whole = frame(Op.EXISTS, b"x" * 100)
    client.sendall(whole[:7])  # half a header
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    _later(0.01, lambda: client.sendall(whole[7:]))
    assert fs.recv_header() == (Op.EXISTS, 100, 0)
    assert fs.recv_bytes(100) == b"x" * 100


def test_a_peer_that_hangs_up_ends_the_poll_and_the_read_sees_eof(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    _later(0.01, client.close)
    deadline = time.monotonic() + 5
    assert fs.poll_next(lambda: time.monotonic() < deadline)
    with pytest.raises(EOFError):
        fs.recv_header(idle=True)


# -- IdlePoller ------------------------------------------------------------------------


def test_a_lone_client_is_polled_for_and_counted(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    counters = NodeCounters()
    poller = IdlePoller(0.5, counters)
    poller.served(1)
    _later(0.01, lambda: client.sendall(frame(Op.EXISTS, b"")))
    assert poller.wait(fs, 1)
    assert fs.recv_header() == (Op.EXISTS, 0, 0)
    poller.served(1)
    t0 = time.monotonic()
    assert not IdlePoller(0.02, counters).wait(fs, 1)  # nothing comes: the window ends it
    assert time.monotonic() - t0 < 1.0
    assert counters.get("data_polls_caught") == 1
    assert counters.get("data_polls_missed") == 1


def test_a_window_of_zero_never_polls(pair: tuple[FrameSocket, socket.socket]) -> None:
    fs, _ = pair
    counters = NodeCounters()
    poller = IdlePoller(0.0, counters)
    assert not poller.enabled
    assert not poller.wait(fs, 1)
    assert counters.snapshot() == {}


def test_another_connections_request_ends_a_poll(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, _ = pair
    poller = IdlePoller(10.0)
    poller.served(1)
    _later(0.02, lambda: poller.served(2))
    t0 = time.monotonic()
    assert not poller.wait(fs, 1)
    assert time.monotonic() - t0 < 5.0  # far short of the 10 s window


def test_one_poller_at_a_time(pair: tuple[FrameSocket, socket.socket]) -> None:
    fs, client = pair
    poller = IdlePoller(10.0)
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
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    fs, client = pair
    poller = IdlePoller(0.5, quiet_s=0.2)
    poller.served(1)
    poller.served(2)  # one change of client: a hand-over, polling stays on
    client.sendall(frame(Op.EXISTS, b""))
    assert poller.wait(fs, 2)
    fs.recv_header()
    poller.served(1)  # a second change within quiet_s: interleaving clients
    t0 = time.monotonic()
    assert not poller.wait(fs, 1)
    assert time.monotonic() - t0 < 0.1  # refused, not polled
    time.sleep(0.25)  # quiet_s later, a lone client is polled for again
    client.sendall(frame(Op.EXISTS, b""))
    assert poller.wait(fs, 1)


def test_neither_end_polls_when_both_share_a_process(
    pair: tuple[FrameSocket, socket.socket],
) -> None:
    """The poller would hold the GIL the other end needs to answer."""
    fs, client = pair
    here = Presence()
    assert here.server_may_poll and here.client_may_poll
    here.clients, here.servers = True, 1
    assert not here.server_may_poll and not here.client_may_poll
    PRESENCE.clients = True  # a client opened a data connection in this process
    client.sendall(frame(Op.EXISTS, b""))
    time.sleep(0.05)
    assert not IdlePoller(5.0).wait(fs, 1)  # refused at once, though a frame is waiting


def test_the_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="data_poll_us"):
        ServerConfig(allow_anonymous=True, data_poll_us=-1)
    with pytest.raises(ConfigError, match="data_poll_us"):
        ServerConfig(allow_anonymous=True, data_poll_us=20_000)
    assert ServerConfig(allow_anonymous=True, data_poll_us=0).data_poll_us == 0


# -- the client's poll for a reply -------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.05])
def test_a_reply_is_read_whole_however_long_it_takes(
    pair: tuple[FrameSocket, socket.socket], delay_s: float
) -> None:
    """Within the poll window, just past it and far past it: the same reply."""
    server_fs, client_sock = pair
    conn = DataConn(FrameSocket(client_sock, max_meta=1 << 20), pb.InfoResponse())
    conn.reply_poll_s = 0.001

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
    server = server_factory(data_poll_us=5000)
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
