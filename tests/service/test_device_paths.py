"""The client's device paths (kvstore/client/device/, transport/device_paths.py) run on
CPU against a real ``kvstore serve``: the host copy engine claims CPU tensors, so shm
and TCP reads and puts go through exactly the code CUDA tensors take (batches, staging,
slot and lease checks after the copies), with a registry over a recording cudart.
tests/gpu/test_client_cuda.py runs the same checks on a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore import StoreClient
from kvstore.copies.host import HostCopyEngine
from kvstore.copies.registry import HostRegistry
from tests.support import device_checks as checks
from tests.support.cudart import RecordingCudart
from tests.support.server_process import ServerProcess

pytest_plugins = ["tests.support.server_fixtures"]
pytestmark = pytest.mark.process


@pytest.fixture(params=["shm", "tcp"])
def client(request: pytest.FixtureRequest, store_server: ServerProcess) -> Iterator[StoreClient]:
    engine = HostCopyEngine()
    registry = HostRegistry(RecordingCudart)
    with checks.device_client(store_server, request.param, engine, registry) as c:
        yield c
    assert engine.stats["batches"] >= 1  # the device paths were taken
    assert registry.live() == 0  # released when the client closed


def test_batch_get_into_lands_exact_bytes(client: StoreClient) -> None:
    checks.check_batch_get_into(client, "cpu")


def test_puts_from_device_tensors_come_back_exact(client: StoreClient) -> None:
    checks.check_puts_from_device(client, "cpu")


def test_same_host_reads_hash_and_stage_nothing(
    store_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    with checks.device_client(
        store_server, "shm", HostCopyEngine(), HostRegistry(RecordingCudart)
    ) as c:
        checks.check_no_host_hash_or_copy(c, "cpu", monkeypatch)


def test_rewritten_blocks_never_read_wrong(store_server: ServerProcess) -> None:
    engine = HostCopyEngine()
    with (
        checks.device_client(store_server, "shm", engine, HostRegistry(RecordingCudart)) as c,
        store_server.client(namespace=checks.NS, transport="tcp") as writer,
    ):
        checks.check_rewrites_never_give_wrong_bytes(c, writer, "cpu")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_failed_registration_stages_exact_bytes(
    store_server: ServerProcess, transport: str
) -> None:
    checks.check_a_failed_registration_stages(store_server, transport, "cpu", HostCopyEngine())
