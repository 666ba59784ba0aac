"""UcxFrames.recv_many between two UCX workers of this process (UCX over tcp on
loopback, a socket pair as the connection's lifeline): a reply's payloads received at
once, each straight into its own view and hashed, whatever the sender's message
boundaries.

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
from kvstore.errors import KVStoreError, TimeoutError_
from kvstore.wire.frames import Op, ProtocolError
from kvstore.wire.ucx import _CTL_CAP, _LEN, UcxFrames, UcxWorker, new_tag
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
    sender = UcxFrames(a, tag, a_sock, max_meta=1 << 20)
    receiver = UcxFrames(b, tag, b_sock, max_meta=1 << 20)
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

    def send() -> None:
        sender.send(Op.GET, b"meta", parts, total)
        sender._flush_owned()  # a small frame leaves while the sender makes progress

    t = _Sender(send)
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


def test_a_small_body_comes_with_its_header(ucx_pair: tuple[UcxFrames, UcxFrames]) -> None:
    """A body of 64 KiB or less travels in the header's message: the views are filled
    from what is buffered, empty views included."""
    parts = [_payload(10, 1), _payload(0, 2), _payload(100, 3)]
    _receive(ucx_pair, parts, [10, 0, 100])


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


def test_metadata_larger_than_the_control_buffer_arrives_whole(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """A control message longer than the receiver's control buffer: its tail follows
    under the overflow tag, and the frame after it is read in step."""
    sender, receiver = ucx_pair
    meta = np.random.default_rng(7).integers(0, 255, 3 * _CTL_CAP, np.uint8).tobytes()
    small = _payload(100, 8)

    def send() -> None:
        sender.send(Op.EXISTS, meta)
        sender.send(Op.GET, b"next", [small], small.nbytes)
        sender._flush_owned()

    t = _Sender(send)
    op, meta_len, body_len = receiver.recv_header()
    assert (op, meta_len, body_len) == (Op.EXISTS, len(meta), 0)
    assert receiver.recv_bytes(meta_len) == meta
    op, meta_len, body_len = receiver.recv_header()
    assert (op, receiver.recv_bytes(meta_len), body_len) == (Op.GET, b"next", 100)
    out = np.zeros(100, np.uint8)
    receiver.recv_into(memoryview(out))
    assert np.array_equal(out, small)
    t.join(20)
    assert not t.errors


@pytest.mark.parametrize("claim", [0, 1 << 30])
def test_a_control_message_with_a_false_length_is_refused(
    ucx_pair: tuple[UcxFrames, UcxFrames], claim: int
) -> None:
    """A peer that claims an empty or a huge control message: a protocol error, and the
    connection is done."""
    sender, receiver = ucx_pair
    t = _Sender(
        lambda: (sender._send([(sender._ctl, _LEN.pack(claim))], True), sender._flush_owned())
    )
    with pytest.raises(ProtocolError):
        receiver.recv_header()
    assert receiver.broken
    t.join(20)


def test_a_control_message_past_the_buffer_is_an_error_not_a_frame(
    ucx_pair: tuple[UcxFrames, UcxFrames],
) -> None:
    """More bytes under the control tag than the control buffer holds, with no
    overflow: UCX truncates the receive, which fails the connection."""
    sender, receiver = ucx_pair
    blob = _LEN.pack(2 * _CTL_CAP) + bytes(2 * _CTL_CAP)
    t = _Sender(lambda: (sender._send([(sender._ctl, blob)], True), sender._flush_owned()))
    receiver.set_timeout(5)
    with pytest.raises(KVStoreError):
        receiver.recv_header()
    assert receiver.broken
    t.join(20)
