"""A SIGKILLed ``kvstore serve`` (no --shm-name) cannot unlink its DRAM segment or its
index (issue 18); the next node to start on the host reclaims them. Segments of live
nodes are left alone."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.shm.index import index_name
from kvstore.shm.segment import SHM_DIR, sweep_stale
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA, ServerProcess, base_flags

pytestmark = pytest.mark.process

SMALL = {"dram_bytes": "8MiB", "ssd_bytes": "16MiB"}


def _files(server: ServerProcess) -> list[Path]:
    name = server.facts["shm_name"]
    return [Path(SHM_DIR, name), Path(SHM_DIR, index_name(name))]


def _crash(server: ServerProcess) -> None:
    """SIGKILL by PID and reap it, without the harness's own cleanup of its segment."""
    os.kill(server.pid, signal.SIGKILL)
    assert server.proc is not None
    server.proc.wait(10)


def test_segments_of_killed_servers_are_reclaimed_at_the_next_start(
    server_factory: ServerFactory,
) -> None:
    doomed = []
    for i in range(2):  # started side by side: each start is mostly imports
        workdir = server_factory.root / f"doomed{i}"
        workdir.mkdir()
        doomed.append(ServerProcess(workdir, {**base_flags(workdir), **SMALL}))
    server_factory.started += doomed  # stopped (by PID) at teardown
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ServerProcess.start, doomed))
    left = [p for server in doomed for p in _files(server)]
    for server in doomed:
        _crash(server)
    assert all(p.exists() for p in left), "a killed server cannot remove its files"
    live = server_factory(**SMALL)
    assert [p for p in left if p.exists()] == []
    assert all(p.exists() for p in _files(live))
    sweep_stale()  # another node starting now leaves a live node's segment alone
    assert all(p.exists() for p in _files(live))
    with live.client(ALPHA, transport="shm") as c:
        assert c.put(b"t" * 16, b"y" * 64) and c.transport == "shm"
