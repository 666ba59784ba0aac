"""Shared fixtures: a clean KVSTORE_ environment and small block helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _clean_kvstore_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees a KVSTORE_* variable it did not set itself."""
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)
    yield
