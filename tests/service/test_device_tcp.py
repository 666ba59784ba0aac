"""The TCP transport's device paths on CPU (issue 31, "TCP reads into CUDA", "Puts from
CUDA"): the host copy engine claims CPU tensors, so reads and puts go through exactly
the code CUDA tensors take, against a peer that speaks the frames by hand
(tests/support/device_wire.py). Hermetic: no process is started.

A read whose payload fails its xxh3 is a miss and its tensor is never written. A put
streams: each payload is copied device-to-host into a ring of pinned staging buffers,
item i is hashed and sent while the next ones copy, a buffer takes another copy only
after its send returned, and at most ring-size copies are in flight. The engine and
the connection here record what they do and delegate to the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.device_paths import PUT_SLOTS
from kvstore.copies.engine import Batch, Completion
from kvstore.copies.host import HostCopyEngine
from kvstore.errors import DeviceError
from tests.support import device_wire as wire

Event = tuple[str, int]


def _addr(buf: Any) -> int:
    return int(np.frombuffer(memoryview(buf).cast("B"), np.uint8).ctypes.data)


class _RecordedMark(Completion):
    def __init__(self, engine: RecordingEngine, inner: Completion, upto: int) -> None:
        self.engine, self.inner, self.upto = engine, inner, upto

    def wait(self) -> None:
        self.inner.wait()
        self.engine.done = max(self.engine.done, self.upto)
        self.engine.events.append(("done", self.upto))


class _RecordedBatch(Batch):
    """A host batch that records each copy out of a tensor as it is queued."""

    def __init__(self, engine: RecordingEngine, inner: Batch) -> None:
        super().__init__(engine)
        self.rec, self.inner = engine, inner

    def h2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self.inner.h2d(dsts, srcs)

    def d2d(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self.inner.d2d(dsts, srcs)

    def d2h(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        rec = self.rec
        if rec.fail_at is not None and rec.queued >= rec.fail_at:
            raise DeviceError("copy failed: an illegal memory access (injected)")
        self.inner.d2h(dsts, srcs)
        for d in dsts:
            rec.queued += 1
            rec.events.append(("d2h", _addr(d)))
        rec.most_in_flight = max(rec.most_in_flight, rec.queued - rec.done)

    def mark(self) -> Completion:
        return _RecordedMark(self.rec, self.inner.mark(), self.rec.queued)


class RecordingEngine(HostCopyEngine):
    """The host engine (copies deferred until waited for), recording the staging
    buffers it hands out, each copy queued and each point waited for; ``fail_at``:
    the copy of that index fails as a device would."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.buffers: list[tuple[int, int]] = []  # (address, size) of staging
        self.queued = self.done = self.most_in_flight = 0
        self.fail_at = fail_at

    def staging(self, n: int) -> Any:
        staged = super().staging(n)
        self.buffers.append((_addr(staged.view), n))
        return staged

    def begin(self, device: Any, *, after_caller: bool = True, after_slab: bool = False) -> Batch:
        inner = super().begin(device, after_caller=after_caller, after_slab=after_slab)
        return _RecordedBatch(self, inner)

    def slot_of(self, addr: int) -> int:
        for i, (base, n) in enumerate(self.buffers):
            if base <= addr < base + n:
                return i
        raise AssertionError(f"{addr:#x} is in no staging buffer")


class RecordingConn(DataConn):
    """A data connection that records, after each send returned, what it sent: a
    payload piece by its address, a trailing sum as the end of an item."""

    events: list[Event]

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        super().send_more(parts, wait=wait)
        for p in parts:
            self.events.append(("sum", 0) if isinstance(p, bytes) else ("sent", _addr(p)))


def _values(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # 1.25 MiB each: three pieces of a send
    return [torch.randn((5, 128, 1024), generator=g).to(torch.bfloat16) for _ in range(n)]


def test_a_corrupt_payload_is_a_miss_and_never_lands() -> None:
    engine = HostCopyEngine()
    wire.check_corrupt_payloads_are_misses(engine, "cpu")
    assert engine.stats["batches"] >= 1  # the device path took them


def test_a_put_streams_through_the_staging_ring() -> None:
    engine = RecordingEngine()
    n = 10
    with wire.device_tcp(engine, RecordingConn) as (transport, conn, peer):
        assert isinstance(conn, RecordingConn)
        conn.events = engine.events  # one timeline
        wire.check_put_bytes_at_the_peer(transport, conn, peer, _values(n, seed=3))
    assert len(engine.buffers) <= PUT_SLOTS  # a bounded ring, not a buffer per value
    assert engine.most_in_flight == PUT_SLOTS  # ... kept full while sending
    owner: dict[int, int] = {}  # staging buffer -> item whose copy it holds
    queued_at: dict[int, int] = {}
    first_send: dict[int, int] = {}
    queued = done = sending = 0
    for t, (kind, a) in enumerate(engine.events):
        if kind == "d2h":
            owner[engine.slot_of(a)] = queued
            queued_at[queued] = t
            queued += 1
        elif kind == "done":
            done = max(done, a)
        elif kind == "sent":
            # the buffer still holds this item: no copy was queued into it before its
            # send returned; and its copy was waited for before the send
            assert owner[engine.slot_of(a)] == sending, (t, sending)
            assert done > sending, (t, sending)
            first_send.setdefault(sending, t)
        else:
            sending += 1
    assert queued == sending == n
    for i in range(n - 1):  # item i + 1 copies while item i is hashed and sent
        assert queued_at[i + 1] < first_send[i], i


def test_a_device_error_mid_put_breaks_the_connection_and_drains_the_copies() -> None:
    engine = RecordingEngine(fail_at=6)
    with wire.device_tcp(engine) as (transport, conn, peer):
        peer.answer_put()
        keys = wire.keys_for(10)
        with pytest.raises(DeviceError, match="illegal memory access"):
            transport.write(conn, keys, _values(10, seed=4), pb.Scope(), wire.deadline())
        assert not conn.usable  # the frame was cut short: the connection goes
        assert engine.done == engine.queued == 6  # nothing in flight into the ring
        conn.fs.close()
        peer.join()
    assert len(peer.errors) == 1 and isinstance(peer.errors[0], EOFError)
    assert not peer.received  # the peer never saw a whole frame


def test_host_values_keep_the_host_path() -> None:
    engine = RecordingEngine()
    values = [np.full(300_000, i, dtype=np.uint8) for i in range(3)]
    with wire.device_tcp(engine) as (transport, conn, peer):
        peer.answer_put()
        got = transport.write(conn, wire.keys_for(3), values, pb.Scope(), wire.deadline())
        peer.join()
    assert got == [True] * 3
    assert [d for d in peer.received[0][1]] == [v.tobytes() for v in values]
    assert engine.stats["batches"] == 0 and not engine.buffers
