"""The client's CUDA paths against a real ``kvstore serve`` on this host (issue 31):
same-host reads DMA from the registered segment into CUDA tensors (no host hash, no
staging), TCP reads land through pinned staging, puts copy device-to-host into the
reserved extents; a block rewritten during a read and a segment the driver refuses to
register still give exact bytes; over TCP a payload corrupted on the way is a miss that
never lands, and a put streams through a bounded ring of pinned buffers. Skipped
without a CUDA device (tests/conftest.py). tests/service/test_device_paths.py and
tests/service/test_device_tcp.py run the same checks on CPU with the host engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvstore import StoreClient
from kvstore.copies.cuda import process_engine
from tests.support import device_checks as checks
from tests.support import device_wire as wire
from tests.support.server_process import ServerProcess

pytest_plugins = ["tests.support.server_fixtures"]
pytestmark = [pytest.mark.cuda, pytest.mark.process]


@pytest.fixture(params=["shm", "tcp"])
def client(request: pytest.FixtureRequest, store_server: ServerProcess) -> Iterator[StoreClient]:
    with checks.device_client(store_server, request.param) as c:
        yield c


def test_batch_get_into_cuda_tensors_exact_bytes(client: StoreClient) -> None:
    before = process_engine().stats["batches"]
    checks.check_batch_get_into(client, "cuda")
    assert process_engine().stats["batches"] > before  # the CUDA engine moved them


def test_puts_from_cuda_tensors_come_back_exact(client: StoreClient) -> None:
    checks.check_puts_from_device(client, "cuda")


def test_same_host_cuda_reads_hash_and_stage_nothing(
    store_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    with checks.device_client(store_server, "shm") as c:
        checks.check_no_host_hash_or_copy(c, "cuda", monkeypatch)


def test_one_wait_per_same_host_batch(store_server: ServerProcess) -> None:
    engine = process_engine()
    with checks.device_client(store_server, "shm") as c:
        checks.check_batch_get_into(c, "cuda", n=8)  # warm: registration, namespace
        keys = checks.fresh_keys(32)
        assert c.batch_put(keys, checks.blocks(32, "cpu", seed=5)) == [True] * 32
        import torch

        outs = [torch.empty(checks.SHAPE, dtype=torch.bfloat16, device="cuda") for _ in keys]
        syncs = engine.stats["syncs"]
        assert c.batch_get_into(keys, outs) == [True] * 32
        assert engine.stats["syncs"] - syncs == 1


def test_rewritten_blocks_never_read_wrong_into_cuda(store_server: ServerProcess) -> None:
    with (
        checks.device_client(store_server, "shm") as c,
        store_server.client(namespace=checks.NS, transport="tcp") as writer,
    ):
        checks.check_rewrites_never_give_wrong_bytes(c, writer, "cuda")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_failed_registration_stages_exact_bytes_cuda(
    store_server: ServerProcess, transport: str
) -> None:
    checks.check_a_failed_registration_stages(store_server, transport, "cuda", None)


def test_a_corrupt_tcp_payload_is_a_miss_and_never_lands_in_cuda() -> None:
    """A batch read over TCP into CUDA tensors whose third payload is corrupted on the
    way: that block is a miss and its tensor keeps what it held; the others are hits
    with exact bytes (tests/support/device_wire.py, the same check the CPU run makes)."""
    before = process_engine().stats["batches"]
    wire.check_corrupt_payloads_are_misses(None, "cuda")
    assert process_engine().stats["batches"] > before  # the CUDA engine landed them


def test_a_tcp_put_from_cuda_streams_through_the_staging_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten 1.25 MiB CUDA tensors, filled on a producer stream behind a long kernel, put
    over TCP: the copies wait for the producer (exact bytes at the peer), and at most
    a ring of pinned staging buffers is allocated, not one per value."""
    import torch

    from kvstore.client.transport.device_paths import PUT_SLOTS
    from kvstore.copies.cuda import CudaCopyEngine

    allocated: list[int] = []
    staging = CudaCopyEngine.staging

    def counted(self: CudaCopyEngine, n: int) -> Any:
        allocated.append(n)
        return staging(self, n)

    monkeypatch.setattr(CudaCopyEngine, "staging", counted)
    g = torch.Generator().manual_seed(31)
    host = [torch.randn((5, 128, 1024), generator=g).to(torch.bfloat16) for _ in range(10)]
    src = [h.to("cuda") for h in host]
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with wire.device_tcp(None) as (transport, conn, peer), torch.cuda.stream(producer):
        values = [torch.empty_like(s) for s in src]
        torch.cuda._sleep(50_000_000)  # the fills land well after the put is enqueued
        for v, s in zip(values, src, strict=True):
            v.copy_(s)
        expect = [wire.raw(h) for h in host]
        wire.check_put_bytes_at_the_peer(transport, conn, peer, values, expect)
    assert 0 < len(allocated) <= PUT_SLOTS


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_async_put_from_a_side_stream_copies_after_the_callers_work(
    store_server: ServerProcess, transport: str
) -> None:
    """The async client runs its calls on executor threads, whose current stream is
    the default one: the copies must still wait for the stream current where the call
    was made (kvstore/copies/caller.py), here a producer behind a long kernel."""
    import asyncio

    import torch

    from kvstore import AsyncStoreClient
    from tests.support.server_process import ALPHA

    host = checks.blocks(6, "cpu", seed=7)
    src = [h.to("cuda") for h in host]
    keys = checks.fresh_keys(6)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()

    async def body() -> list[Any]:
        async with AsyncStoreClient(
            store_server.address, token=ALPHA.token, transport=transport, namespace=checks.NS
        ) as c:
            with torch.cuda.stream(producer):
                values = [torch.empty_like(s) for s in src]
                torch.cuda._sleep(50_000_000)  # the fills land well after the put is queued
                for v, s in zip(values, src, strict=True):
                    v.copy_(s)
                assert await c.batch_put(keys, values) == [True] * 6
            return list(await c.batch_get(keys))

    got = asyncio.run(asyncio.wait_for(body(), 60))
    assert all(
        torch.equal(torch.as_tensor(g).view(h.shape), h) for g, h in zip(got, host, strict=True)
    )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_sharded_read_lands_in_an_engines_inference_tensors(
    tmp_path: Any, transport: str
) -> None:
    """A prefill loads its prefix under ``torch.inference_mode()`` into tensors it
    allocated there, on its own stream; a sharded node's parts land on pool threads,
    which run as the caller (kvstore/copies/caller.py). A smoke test of that path: in
    torch 2.13 the client's byte views of such tensors escape the inference check
    anyway; tests/gpu/test_copies_cuda.py checks the mechanism itself."""
    import torch

    from tests.support.server_process import base_flags

    flags = base_flags(tmp_path)
    flags.update(shards=2, dram_bytes="32MiB", max_value_bytes="4MiB")
    srv = ServerProcess(tmp_path, flags).start()
    try:
        with checks.device_client(srv, transport) as c:
            keys = checks.fresh_keys(12)
            values = checks.blocks(12, "cpu", seed=11)
            assert c.batch_put(keys, values) == [True] * 12
            side = torch.cuda.Stream()
            with torch.inference_mode(), torch.cuda.stream(side):
                outs = [torch.empty_like(values[0], device="cuda") for _ in keys]
                assert c.batch_get_into(keys, outs) == [True] * 12
                side.synchronize()
            for v, out in zip(values, outs, strict=True):
                assert torch.equal(out.cpu().view(torch.int16), v.view(torch.int16))
    finally:
        srv.stop()
