"""Shared test policy: a clean KVSTORE_ environment, and the ``process`` marker.

Every test that starts a process (a ``kvstore serve`` child, etcd, an engine, a
subprocess of any kind) is marked ``process``, so ``pytest -m "not process"`` is the
hermetic run: in-process nodes, in-memory seams, loopback sockets of this process only.
Tests that use a process-starting fixture are marked here; a test that starts one
itself carries ``@pytest.mark.process``. An unmarked test that tries to start a process
fails at once, naming the marker, so the split cannot drift.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

pytest_plugins = [
    "tests.support.server_fixtures",
    "tests.support.etcd_fixtures",
    "tests.support.memory_fixtures",
    "tests.support.sharded_node",
]

# UCX (kvstore/wire/ucx.py) moves test bytes over loopback only, in this process and in
# every child that inherits its environment (tests across network namespaces name their
# own device).
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# Fixtures whose setup starts processes, or which hand the test a factory that does.
PROCESS_FIXTURES = frozenset(
    {
        "etcd_locked",
        "etcd_private",
        "etcd_server",
        "etcd_tls",
        "pair",
        "server_factory",
        "shared",
        "store",
        "store_server",
        "store_server_ucx",
        "engines",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda and not _cuda_device():
        skip = pytest.mark.skip(reason="needs a CUDA device (scripts/device_check.sh runs these)")
        for item in cuda:
            item.add_marker(skip)


def _cuda_device() -> bool:
    """Whether torch sees a CUDA device; torch is imported only when a ``cuda`` test was
    collected."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True)
def _clean_kvstore_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees a KVSTORE_* variable it did not set itself."""
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)
    yield


# What ctypes.util.find_library runs to find a shared library: a first ``import torch``
# (through cuda.pathfinder) can do that inside any test. It is a library lookup, not a
# process the test starts.
_LIBRARY_PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump"})


def _library_probe(argv: Any) -> bool:
    if isinstance(argv, str | bytes | os.PathLike):
        argv = [argv]
    if not argv:
        return False
    return os.path.basename(os.fsdecode(argv[0])) in _LIBRARY_PROBES


@pytest.fixture(autouse=True)
def _processes_only_where_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refuse to start a process from a test that is not marked ``process``."""
    if request.node.get_closest_marker("process") is not None:
        return
    popen_init = subprocess.Popen.__init__

    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _library_probe(args[1] if len(args) > 1 else kwargs.get("args")):
            return popen_init(*args, **kwargs)
        raise RuntimeError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.process "
            "(or use a fixture listed in tests/conftest.py PROCESS_FIXTURES)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)  # type: ignore[method-assign]
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
