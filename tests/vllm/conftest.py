"""The vLLM engine modules' store: one ``kvstore serve`` per module, in the module's own
``root`` directory (each module defines ``root``), stopped by PID at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess, base_flags


@pytest.fixture(scope="module")
def store(root: Path) -> Iterator[ServerProcess]:
    workdir = root / "store"
    workdir.mkdir()
    server = ServerProcess(workdir, base_flags(workdir)).start()
    try:
        yield server
    finally:
        server.stop()
