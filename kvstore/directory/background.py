"""A Directory run on the process's directory event loop, for synchronous callers.

A :class:`~kvstore.directory.base.Directory` is asyncio and bound to the loop that
opened it, while :class:`~kvstore.client.store.StoreClient` and its cluster sibling are
blocking (see kvstore/client/store.py for why). This helper gives such a caller the
directory's watch-fed :class:`Mirror`, which is thread-safe to read, while the watch
itself keeps running on a loop nobody else has to drive.

Every BackgroundDirectory of a process runs on one event loop thread (started on first
use, never stopped). grpc.aio, under aetcd, polls for completions process-wide; with a
loop per directory, loops that came and went left completions dispatched to a closed
loop ("Event loop is closed") and channels whose close never finished, each keeping a
socket to etcd open for the life of the process.

Lifecycle: ``start()`` opens the directory and waits for the mirror's first full
listing (bounded); ``close()`` closes the directory on the loop; both are idempotent.
``call()`` runs any other directory coroutine there (``list_nodes``, or a test
registering a node) and waits for its result.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvstore.directory.base import Directory
from kvstore.directory.mirror import Mirror
from kvstore.errors import ClosedError, TimeoutError_

__all__ = ["BackgroundDirectory"]

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 15.0  # the least close() waits for the directory to close on its loop

T = TypeVar("T")


class BackgroundDirectory:
    """Owns one Directory and the thread whose loop it lives on.

    ``factory`` builds the directory inside that loop (aetcd binds its channel to
    the loop it is created on). ``timeout`` bounds opening and every ``call``.
    """

    def __init__(self, factory: Callable[[], Directory], *, timeout: float = 10.0) -> None:
        self._factory = factory
        self.timeout = timeout
        self.directory: Directory | None = None
        self.mirror: Mirror | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._deregister = True

    def start(self) -> Mirror:
        """Start the loop, open the directory, return its synced mirror."""
        with self._lock:
            if self._closed:
                raise ClosedError("background directory is closed")
            if self.mirror is not None:
                return self.mirror
            self._loop = directory_loop()
        try:
            self.mirror = self.call(self._open)
        except BaseException:
            self.close()
            raise
        return self.mirror

    async def _open(self) -> Mirror:
        self.directory = self._factory()
        await self.directory.open()
        return await self.directory.mirror()

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float | None = None) -> T:
        """Run ``fn()`` on the directory's loop; its result, or its exception."""
        if self._closed:
            raise ClosedError("background directory is closed")
        return self._submit(fn, timeout)

    def _submit(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float | None) -> T:
        loop = self._loop
        if loop is None:
            raise ClosedError("background directory is not started")
        fut = asyncio.run_coroutine_threadsafe(fn(), loop)
        wait = self.timeout if timeout is None else timeout
        try:
            return fut.result(wait)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError_(f"directory call did not finish within {wait:.1f} s") from None
        finally:
            # The future holds the failure it raises, whose traceback holds this frame:
            # a cycle that would keep the failed etcd call (and, through it, a closed
            # channel's socket) until the cyclic GC ran. See etcd.py's _end_all.
            del fut

    def close(self, *, deregister: bool = True) -> None:
        """Close the directory (revoking its own registrations unless told not to),
        stop the loop, join the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop = self._loop
        if loop is None:
            return
        self._deregister = deregister
        # Closing gets its own, longer bound (a busy machine can take longer than a
        # call's timeout); past it the close goes on, on the loop, without the caller.
        bound = max(self.timeout, CLOSE_TIMEOUT_S)
        try:
            self._submit(self._shutdown, bound)
        except Exception as exc:
            log.warning("directory did not close cleanly within %.1f s: %s", bound, exc)

    async def _shutdown(self) -> None:
        if self.directory is not None:
            await self.directory.close(deregister=self._deregister)

    def __enter__(self) -> BackgroundDirectory:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LOOP_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_THREAD: threading.Thread | None = None


def directory_loop() -> asyncio.AbstractEventLoop:
    """The process's directory event loop, running on its own daemon thread (started
    here on first use, and again in a child that forked after it)."""
    global _LOOP, _LOOP_THREAD
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP_THREAD is None or not _LOOP_THREAD.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="kvstore-directory", daemon=True
            )
            thread.start()
            _LOOP, _LOOP_THREAD = loop, thread
        return _LOOP


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
