"""Background load for tests: worker threads that run until the ``with`` block ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self


class Background:
    """Starts ``threads`` on entry; on exit sets ``stop`` and joins them (bounded).

    Subclasses build their loops as methods that return once ``stop`` is set.
    """

    def __init__(self, *loops: Callable[[], None]) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in loops]

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
