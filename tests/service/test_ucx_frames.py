"""UcxFrames between two UCX workers of this process (UCX over tcp on loopback, a
socket pair carrying headers, metadata and small bodies): a reply's payloads received
at once, each straight into its own view and hashed, whatever the sender's message
boundaries; and a peer that breaks the split between the two carriers.

The sender runs in a thread: a payload above UCX's eager limit is a rendezvous, which
completes only while the receiver makes progress.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.blocks import checksum_stream
from kvstore.errors import TimeoutError_
from kvstore.wire.frames import FrameSocket, Op, ProtocolError
from kvstore.wire.ucx import _SMALL, UcxFrames, UcxWorker, new_tag
from kvstore.wire.ucx import available as ucx_available

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def ucx_pair() -> Iterator[tuple[UcxFrames, UcxFrames]]:
    """(sender, receiver) on one connection tag."""
    a_sock, b_sock = socket.socketpair()
    a, b = UcxWorker(), UcxWorker()
    a.connect(b.address)
    b.connect(a.address)
    tag = new_tag()
    sender = UcxFrames(a, tag, FrameSocket(a_sock, max_meta=1 << 20))
    receiver = UcxFrames(b, tag, FrameSocket(b_sock, max_meta=1 << 20))
    for fs in (sender, receiver):
        fs.set_timeout(20)
    yield sender, receiver
    sender.close()
    receiver.close()


class _Sender(threading.Thread):
    """Runs ``fn`` in its own thread; ``errors`` holds what it raised."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.errors: list[BaseException] = []
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:
            self.errors.append(exc)


def _payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def _receive(
    ucx_pair: tuple[UcxFrames, UcxFrames], parts: list[np.ndarray], sizes: list[int]
) -> list[np.ndarray]:
    """Send one frame whose body is ``parts`` (one message each, or one with the
    header when small), receive its body into views of ``sizes``; check every view's
    bytes and digest against the sent stream."""
    sender, receiver = ucx_pair
    total = sum(p.nbytes for p in parts)
    assert sum(sizes) == total

    t = _Sender(lambda: sender.send(Op.GET, b"meta", parts, total))
    op, meta_len, body_len = receiver.recv_header()
    assert (op, body_len) == (Op.GET, total)
    assert receiver.recv_bytes(meta_len) == b"meta"
    outs = [np.zeros(n, np.uint8) for n in sizes]
    digests = [checksum_stream() for _ in sizes]
    receiver.recv_many([memoryview(o) for o in outs], digests)
    t.join(20)
    assert not t.is_alive() and not t.errors
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    at = 0
    for out, digest in zip(outs, digests, strict=True):
        assert np.array_equal(out, stream[at : at + out.nbytes])
        assert digest.intdigest() == xxhash.xxh3_64_intdigest(out.tobytes())
        at += out.nbytes
    assert receiver.buffered == 0
    return outs


def test_payloads_that_match_the_views_land_in_them(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    """Rendezvous payloads and eager ones, one message per view."""
    parts = [_payload(MiB, 1), _payload(4 * KiB, 2), _payload(3 * MiB, 3), _payload(70 * KiB, 4)]
    _receive(ucx_pair, parts, [p.nbytes for p in parts])


def test_a_small_body_comes_on_the_socket(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    """A body of 64 KiB or less follows its header on the socket (no UCX message at
    all): the views are filled from it, empty views included."""
    parts = [_payload(10, 1), _payload(0, 2), _payload(100, 3)]
    _receive(ucx_pair, parts, [10, 0, 100])
    sender, _ = ucx_pair
    assert not sender.payloads._lent and not sender.payloads._owned
    edge = [_payload(_SMALL - 8, 4), _payload(8, 5)]  # exactly the limit: still the socket
    _receive(ucx_pair, edge, [_SMALL // 2, _SMALL // 2])
    over = [_payload(_SMALL - 8, 6), _payload(9, 7)]  # one byte more: over UCX
    _receive(ucx_pair, over, [_SMALL, 1])


def test_messages_that_cross_view_ends_still_land_in_order(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """A message longer than what is left of its view ends the pipelining; every byte
    still lands where it belongs."""
    parts = [_payload(MiB // 2, 1), _payload(MiB, 2), _payload(MiB // 2, 3)]
    _receive(ucx_pair, parts, [MiB, MiB])
    _receive(ucx_pair, [_payload(3 * MiB // 2, 4), _payload(MiB // 2, 5)], [MiB, MiB])


def test_empty_views_between_and_after(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    parts = [_payload(MiB, 1), _payload(MiB, 2)]
    _receive(ucx_pair, parts, [0, MiB, 0, 0, MiB, 0])


def test_frames_after_a_batch_stay_in_step(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    """Several batches back to back on one connection: each takes its own messages."""
    for seed in range(4):
        parts = [_payload(MiB + seed, seed), _payload(256 * KiB, seed + 10)]
        _receive(ucx_pair, parts, [p.nbytes for p in parts])


def test_a_sender_that_stalls_mid_batch_times_out(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    """Two payloads announced, one sent: the receive fails within its timeout and the
    connection is marked broken, with nothing left posted into the caller's views."""
    sender, receiver = ucx_pair
    receiver.set_timeout(0.5)
    sent = _payload(MiB, 1)
    t = _Sender(lambda: sender.send(Op.GET, b"", [sent], 2 * MiB))
    _, meta_len, _ = receiver.recv_header()
    receiver.recv_bytes(meta_len)
    outs = [np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)]
    with pytest.raises(TimeoutError_):
        receiver.recv_many([memoryview(o) for o in outs], [None, None])
    assert receiver.broken
    t.join(20)
    assert np.array_equal(outs[0], sent)
    assert not outs[1].any()


def test_metadata_of_any_size_arrives_whole_and_in_step(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """Metadata larger than the socket's read buffer, then a frame with a UCX body and
    one with a small body: each is read in step."""
    sender, receiver = ucx_pair
    meta = np.random.default_rng(7).integers(0, 255, 3 * _SMALL, np.uint8).tobytes()
    big, small = _payload(MiB, 8), _payload(100, 9)

    def send() -> None:
        sender.send(Op.EXISTS, meta)
        sender.send(Op.GET, b"big", [big], big.nbytes)
        sender.send(Op.GET, b"next", [small], small.nbytes)

    t = _Sender(send)
    op, meta_len, body_len = receiver.recv_header()
    assert (op, meta_len, body_len) == (Op.EXISTS, len(meta), 0)
    assert receiver.recv_bytes(meta_len) == meta
    for payload, name in ((big, b"big"), (small, b"next")):
        op, meta_len, body_len = receiver.recv_header()
        assert (op, receiver.recv_bytes(meta_len), body_len) == (Op.GET, name, payload.nbytes)
        out = np.zeros(payload.nbytes, np.uint8)
        receiver.recv_into(memoryview(out))
        assert np.array_equal(out, payload)
    t.join(20)
    assert not t.errors


def test_socket_bytes_while_a_payload_is_due_break_the_connection(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """A peer that announces a UCX body and then sends the next frame on the socket
    instead: a protocol error, never those bytes taken for the payload."""
    sender, receiver = ucx_pair
    sender.fs.send(Op.GET, b"", (), MiB)  # a header whose body never comes over UCX
    sender.fs.send(Op.EXISTS, b"x" * 10)
    _, meta_len, _ = receiver.recv_header()
    receiver.recv_bytes(meta_len)
    out = np.zeros(MiB, np.uint8)
    with pytest.raises(ProtocolError):
        receiver.recv_into(memoryview(out))
    assert receiver.broken
    assert not out.any()


def test_a_payload_past_the_end_of_a_body_is_refused(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """More payload bytes over UCX than the header announced: the next header is a
    protocol error, not a frame read out of step."""
    sender, receiver = ucx_pair
    extra = _payload(MiB, 3)

    def send() -> None:
        sender._send_ucx = True
        sender.fs.send(Op.GET, b"", (), MiB - 10)
        sender.send_more([extra])
        sender.fs.send(Op.EXISTS, b"")

    t = _Sender(send)
    receiver.recv_header()
    out = np.zeros(MiB - 10, np.uint8)
    receiver.recv_into(memoryview(out))
    assert np.array_equal(out, extra[: MiB - 10])
    with pytest.raises(ProtocolError):
        receiver.recv_header()
    assert receiver.broken
    t.join(20)


def test_a_payload_under_another_tag_is_never_taken(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """A message under a tag other than the connection's (a stranger that reached the
    worker but was never told the tag) is not read as a payload: the receive times out
    with the view untouched."""
    sender, receiver = ucx_pair
    sender.payloads.tag = type(sender.payloads.tag)((sender.tag & ~3) ^ (1 << 40) | 1)
    stranger = _payload(MiB, 4)
    t = _Sender(lambda: sender.send(Op.GET, b"", [stranger], MiB, wait=False))
    receiver.set_timeout(0.5)
    receiver.recv_header()
    out = np.zeros(MiB, np.uint8)
    with pytest.raises(TimeoutError_):
        receiver.recv_into(memoryview(out))
    assert not out.any()
    t.join(20)
