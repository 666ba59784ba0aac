"""The client's device paths checked against a real ``kvstore serve``: one body for CUDA
tensors (tests/gpu/test_client_cuda.py) and for CPU tensors moved by the host copy engine
(tests/service/test_device_paths.py), so the CPU run covers the same transport code.

Every check compares every byte read back with what was written (exact bytes, never
wrong bytes), and the same-host checks count host hashes and staging buffers.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch

import kvstore.client.transport.device_paths as device_paths
import kvstore.client.transport.shm_direct as shm_direct
from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.client.connector import SocketConnector
from kvstore.copies.engine import CopyEngine
from kvstore.copies.registry import HostRegistry
from kvstore.copies.staging import StagingRing
from tests.support.cudart import RecordingCudart
from tests.support.server_process import ALPHA, ServerProcess

__all__ = [
    "NS",
    "SHAPE",
    "check_a_failed_registration_stages",
    "check_batch_get_into",
    "check_no_host_hash_or_copy",
    "check_puts_from_device",
    "check_rewrites_never_give_wrong_bytes",
    "device_client",
]

NS = Namespace("device-llama", "bf16:L4:H8:D64", tenant="ignored-by-the-server")
SHAPE = (4, 2, 8, 16, 64)  # 256 KiB of bf16 a block
_seq = itertools.count()


def fresh_keys(n: int) -> list[bytes]:
    base = next(_seq) * 100_000
    return prefix_keys(list(range(base, base + 16 * n)), 16, NS)


def blocks(n: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.bfloat16).to(device) for _ in range(n)]


def device_client(
    server: ServerProcess,
    transport: str,
    engine: CopyEngine | None = None,
    registry: HostRegistry | None = None,
    **kw: Any,
) -> StoreClient:
    connector = SocketConnector(device=engine, registry=registry)
    return server.client(ALPHA, transport=transport, namespace=NS, connector=connector, **kw)


def check_batch_get_into(c: StoreClient, device: str, n: int = 24) -> None:
    """Blocks put from host tensors come back into device tensors, exactly."""
    keys = fresh_keys(n)
    values = blocks(n, "cpu", seed=1)
    assert c.batch_put(keys, values) == [True] * n
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16, device=device) for _ in range(n)]
    assert c.batch_get_into(keys, outs) == [True] * n
    for v, out in zip(values, outs, strict=True):
        assert torch.equal(out.cpu().view(torch.int16), v.view(torch.int16))
    assert c.get_into(keys[0], outs[1]) is True
    assert torch.equal(outs[1].cpu().view(torch.int16), values[0].view(torch.int16))
    missing = fresh_keys(1)
    assert c.batch_get_into([missing[0], keys[2]], outs[:2]) == [False, True]


def check_puts_from_device(c: StoreClient, device: str, n: int = 12) -> None:
    """Blocks put from device tensors come back exactly, into host and device tensors."""
    keys = fresh_keys(n)
    values = blocks(n, device, seed=2)
    assert c.batch_put(keys, values) == [True] * n
    assert c.batch_put(keys[:2], values[:2]) == [False, False]  # already present
    back = c.batch_get(keys)
    for v, b in zip(values, back, strict=True):
        assert torch.equal(b.view(torch.int16), v.cpu().view(torch.int16))
    outs = [torch.empty_like(v) for v in values]
    assert c.batch_get_into(keys, outs) == [True] * n
    for v, out in zip(values, outs, strict=True):
        assert torch.equal(out.view(torch.int16), v.view(torch.int16))


def check_no_host_hash_or_copy(
    c: StoreClient, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A same-host read into device tensors hashes nothing on the host and stages
    nothing: the bytes go by DMA from the registered segment."""
    keys = fresh_keys(16)
    values = blocks(16, "cpu", seed=3)
    assert c.batch_put(keys, values) == [True] * 16
    c.batch_get(keys[:1])  # the first read teaches the direct reader the namespace
    calls = {"hash": 0, "stage": 0}

    def counted_hash(data: Any) -> int:
        calls["hash"] += 1
        return 0

    take = StagingRing.take

    def counted_take(self: StagingRing, n: int) -> Any:
        calls["stage"] += 1
        return take(self, n)

    monkeypatch.setattr(shm_direct, "checksum", counted_hash)
    monkeypatch.setattr(device_paths, "checksum", counted_hash)
    monkeypatch.setattr(StagingRing, "take", counted_take)
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16, device=device) for _ in range(16)]
    assert c.batch_get_into(keys, outs) == [True] * 16
    assert calls == {"hash": 0, "stage": 0}
    for v, out in zip(values, outs, strict=True):
        assert torch.equal(out.cpu().view(torch.int16), v.view(torch.int16))


def check_rewrites_never_give_wrong_bytes(c: StoreClient, writer: StoreClient, device: str) -> None:
    """While another client removes and rewrites a block with other contents, every
    hit of the reader holds exactly one of the two versions."""
    keys = fresh_keys(4)
    versions = [blocks(4, "cpu", seed=10), blocks(4, "cpu", seed=11)]
    assert writer.batch_put(keys, versions[0]) == [True] * 4
    stop = threading.Event()
    errors: list[BaseException] = []

    def rewrite() -> None:
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                writer.remove(keys)
                writer.batch_put(keys, versions[(i + 1) % 2])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=rewrite, daemon=True)
    t.start()
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16, device=device) for _ in range(4)]
    valid = [[v.view(torch.int16) for v in ver] for ver in versions]
    hits = 0
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for j, r in enumerate(c.batch_get_into(keys, outs)):
                if r is True:
                    got = outs[j].cpu().view(torch.int16)
                    assert torch.equal(got, valid[0][j]) or torch.equal(got, valid[1][j])
                    hits += 1
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    assert hits > 0


def check_a_failed_registration_stages(
    server: ServerProcess, transport: str, device: str, engine: CopyEngine | None
) -> None:
    """A segment the driver refuses to register: reads and puts stage through pinned
    buffers and still give exact bytes."""
    refusing = RecordingCudart(fail_at=0)
    registry = HostRegistry(lambda: refusing)
    with device_client(server, transport, engine, registry) as c:
        check_batch_get_into(c, device, n=8)
        check_puts_from_device(c, device, n=6)
    assert not refusing.registered
    if transport == "shm":
        assert refusing.calls and refusing.calls[0][0] == "register"
