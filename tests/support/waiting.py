"""Waiting on a condition instead of sleeping through a race: poll until it holds, and
fail with what was awaited when it does not in time."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(cond: Callable[[], object], what: str, within: float = 10.0) -> None:
    """Return once ``cond()`` is true; AssertionError naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
