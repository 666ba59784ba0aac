"""The caller's CUDA stream, carried to the threads that run parts of its call.

Why: a copy batch is ordered after the work its caller queued on its *current* CUDA
stream (engine.py, ``begin(after_caller=True)``): a put from a tensor an engine is
still writing on a side stream copies it only once it is written. But a call split
over shards or nodes runs its parts on pool threads (kvstore/client/fanout.py), and an
async client's calls run on its executor (kvstore/client/store.py); a pool thread's
current stream is the device's default stream, not the caller's. So the caller's
stream is captured on the calling thread (:func:`caller_stream`) and each part runs
under it (:func:`on_stream`).

Nothing happens, and torch is not imported, in a process that has not started CUDA.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["caller_stream", "on_stream", "with_caller_stream"]

T = TypeVar("T")


def caller_stream() -> Any | None:
    """The calling thread's current CUDA stream, or None when this process has not
    started CUDA (then no copy of this call can be a device copy)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


@contextlib.contextmanager
def on_stream(stream: Any | None) -> Iterator[None]:
    """Make ``stream`` (from :func:`caller_stream`) this thread's current one meanwhile."""
    if stream is None:
        yield
        return
    with sys.modules["torch"].cuda.stream(stream):
        yield


def with_caller_stream(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run on another thread under the stream current here and now."""
    stream = caller_stream()
    if stream is None:
        return fn

    def run() -> T:
        with on_stream(stream):
            return fn()

    return run
