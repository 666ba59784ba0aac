"""The tier seam and the block index, through their public faces: a read handle gives
host bytes, a reservation fills itself, a put asks the index twice; and, read from the
source with ast, no code above tiers/ tests a tier's type or copies device memory."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.blocks import describe
from kvstore.errors import LayoutMismatch, ReservationError
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from kvstore.tiers.base import HostPayload

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8192
TIER_TYPES = {"MemoryTier", "DiskTier", "DevicePayload", "HostPayload"}


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, BLOCK, dtype=np.uint8)


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    n = StoreNode(
        node_id="seam",
        dram_bytes=4 * (BLOCK + 256),
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=16 * (BLOCK + 4096),
    )
    yield n
    n.close()


def test_host_payload_reads_and_fills_in_place() -> None:
    arr = np.zeros(16, dtype=np.uint8)
    p = HostPayload(arr)
    p.write(b"0123456789abcdef")
    assert p.host() is arr and bytes(arr) == b"0123456789abcdef"
    assert p.fill_buffer() is arr
    p.flush()  # nothing staged in host memory
    out = bytearray(16)
    from kvstore.blocks import BlockHeader

    h = BlockHeader.for_value(_key(1), describe(b"0123456789abcdef"), arr)
    p.copy_to(h, out)
    assert bytes(out) == bytes(arr) and p.checksum() == h.checksum
    with pytest.raises(LayoutMismatch):
        p.copy_to(h, bytearray(8))


def test_reservation_fills_itself_and_settles_once(node: StoreNode) -> None:
    v = _value(1)
    res = node.reserve(_key(1), describe(v))
    assert res is not None and not res.done
    assert res.shm_offset == res.offset  # DRAM: a same-host writer may fill it
    res.write(v)
    assert node.commit(res) and res.done
    with pytest.raises(ReservationError):
        node.commit(res)
    node.abort(res)  # harmless once settled
    assert node.reserve(_key(1), describe(v)) is None  # stored already: nothing to fill
    res2 = node.reserve(_key(2), describe(v))
    assert res2 is not None
    res2.payload[:] = v  # through the host buffer
    node.abort(res2)
    node.abort(res2)
    with pytest.raises(ReservationError):
        node.commit(res2)
    assert node.exists([_key(1), _key(2)]) == [True, False]


def test_read_handle_gives_host_bytes_from_every_tier(node: StoreNode) -> None:
    for i in range(8):
        node.put(_key(i), _value(i))
    assert node.tier_of(_key(0)) is TierKind.SSD
    with node.pin(_key(0)) as blk:  # an SSD hit, promoted on the way
        assert blk is not None and blk.hit is TierKind.SSD
        assert bytes(blk.host()) == _value(0).tobytes()
        if blk.tier is TierKind.DRAM:
            assert blk.shm_offset == blk.offset >= 0
        else:
            assert blk.shm_offset == -1
    with node.pin(_key(7)) as blk:
        assert blk is not None and blk.tier is TierKind.DRAM and blk.shm_offset >= 0
        out = np.empty(BLOCK, dtype=np.uint8)
        blk.copy_to(out)
        assert np.array_equal(out, _value(7))


class _CountingLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> Any:
        self.taken += 1
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


def test_a_put_asks_the_index_twice(node: StoreNode) -> None:
    lock = _CountingLock()
    node._index.state.lock = lock  # type: ignore[assignment]
    assert node.put(_key(1), _value(1))
    assert lock.taken == 2  # claim room (key absent), commit
    lock.taken = 0
    assert node.put(_key(1), _value(1)) is False
    assert lock.taken == 1  # stored already: one look


def _modules(*rooms: str) -> list[Path]:
    return [p for room in rooms for p in (ROOT / "kvstore" / room).rglob("*.py")]


def test_no_code_above_tiers_tests_a_tier_type() -> None:
    offenders = []
    rooms = ("node", "server", "client", "cli", "directory", "observe", "wire", "shm")
    for path in _modules(*rooms):
        for n in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in ("isinstance", "issubclass")
                and len(n.args) == 2
            ):
                names = {x.id for x in ast.walk(n.args[1]) if isinstance(x, ast.Name)}
                if names & TIER_TYPES:
                    offenders.append(f"{path.name}:{n.lineno}")
    assert offenders == []


def test_no_code_above_tiers_copies_device_memory() -> None:
    """Device bytes leave and enter HBM only through the tier's Payload; the node and the
    server name the HBM tier only where the node builds it from its config."""
    offenders = []
    for path in _modules("node", "server"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("cpu", "cuda", "copy_"):
                offenders.append(f"{path.name}:{n.lineno} .{n.attr}")
            if isinstance(n, ast.Attribute) and n.attr == "HBM" and path.name != "store.py":
                offenders.append(f"{path.name}:{n.lineno} TierKind.HBM")
            if isinstance(n, ast.alias) and n.name == "torch":
                offenders.append(f"{path.name}:{n.lineno} import torch")
    assert offenders == []
