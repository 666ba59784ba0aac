"""Same-host puts with pipelined commits (issue 19): each COMMIT leaves as soon as its
item is copied and the replies are read at the end of the round. A copy that fails
part-way must leave the items already committed stored, the others invisible and
their reservations aborted, and the connection in step for the next call."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvstore.client.transport import shm as shm_transport
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA

pytestmark = pytest.mark.process

MIB = 1 << 20


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(16 - len(tag), "big") for i in range(n)]


def _leases_settle(c: Any, want: int, within_s: float = 5.0) -> int:
    """The server's open lease count once it reaches ``want`` (or the last seen)."""
    end = time.monotonic() + within_s
    while True:
        n = int(c.stats()["server"]["leases"])
        if n == want or time.monotonic() > end:
            return n
        time.sleep(0.05)


def test_a_batch_put_over_shm_stores_every_item_with_its_bytes(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_bytes="64MiB")
    keys = _keys(8, b"pipe")
    values = [np.random.default_rng(i).integers(0, 255, MIB, dtype=np.uint8) for i in range(8)]
    with server.client(ALPHA, transport="shm") as c:
        assert c.batch_put(keys, values) == [True] * 8
        assert c.transport == "shm"
        assert c.batch_put(keys, values) == [False] * 8  # stored already
        with server.client(ALPHA, transport="tcp") as other:  # checked by another path
            for k, v in zip(keys, values, strict=True):
                got = other.get(k)
                assert got is not None and np.array_equal(np.asarray(got), v)


def test_a_copy_that_fails_mid_batch_aborts_the_rest(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory(dram_bytes="64MiB")
    keys = _keys(6, b"half")
    values = [np.full(MIB, i, dtype=np.uint8) for i in range(6)]
    real = shm_transport.copy_hashed
    calls = {"n": 0}

    def failing(dst: np.ndarray, src: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("injected: the third copy fails")
        return real(dst, src)

    with server.client(ALPHA, transport="shm") as c:
        monkeypatch.setattr(shm_transport, "copy_hashed", failing)
        with pytest.raises(MemoryError):
            c.batch_put(keys, values)
        monkeypatch.setattr(shm_transport, "copy_hashed", real)
        assert c.exists(keys) == [True, True, False, False, False, False]
        assert _leases_settle(c, 0) == 0  # the four reservations were aborted
        # the connection is in step: the next batch stores the rest
        assert c.batch_put(keys, values) == [False, False, True, True, True, True]
        out = np.empty(MIB, dtype=np.uint8)
        for i, k in enumerate(keys):
            assert c.get_into(k, out) and out[0] == i and out[-1] == i
