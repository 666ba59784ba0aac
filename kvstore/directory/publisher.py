"""Carries a StoreNode's block events into the directory, in the background.

A put must never wait for etcd, so the node only appends events to its bounded
queue; this task takes them in batches and publishes them. Batching is where the
throughput comes from: a burst of puts becomes a few 128-op transactions.

Dropped events (the queue overflowed while the directory was slow or down) mean the
stream can no longer be trusted, so the publisher re-lists the node's keys and has
the directory write only the differences. An outage is ridden out: events already
handed to the directory stay pending there and are flushed when etcd returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from kvstore.directory.base import BlockSnapshot, Directory
from kvstore.errors import ConflictError, KVStoreError, NotFound
from kvstore.events import BlockEvent, EventQueue
from kvstore.tier_kinds import TierKind

__all__ = ["EventSource", "Publisher"]

log = logging.getLogger(__name__)


class EventSource(Protocol):
    """What the publisher needs from a node (StoreNode satisfies it)."""

    events: EventQueue

    @property
    def node_id(self) -> str: ...

    @property
    def tiers(self) -> tuple[TierKind, ...]: ...

    def take_events(self, limit: int | None = None) -> list[BlockEvent]: ...

    def snapshot(self) -> Sequence[tuple[bytes, TierKind, int]]: ...


class Publisher:
    """One node's event pump: ``await start()`` ... ``await stop()``, or ``async with``.

    Concurrency contract: one task in the directory's loop owns ``_seen_dropped``
    and the counters; the node's queue is the only state shared with other threads
    (it has its own lock). ``run_once`` may be called directly instead of starting
    the task, but not both at once.
    """

    def __init__(
        self,
        node: EventSource,
        directory: Directory,
        *,
        interval: float = 0.005,
        batch: int = 16384,
        retry: float = 0.25,
    ) -> None:
        self.node = node
        self.directory = directory
        self.interval = interval
        self.batch = batch
        self.retry = retry
        self.revision = 0  # directory revision of the last successful publish
        self.resyncs = 0
        self.failures = 0
        self.error: KVStoreError | None = None  # set when the node lost its id for good
        self._seen_dropped = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the background task (the node must be registered already)."""
        self.directory.registration(self.node.node_id)  # NotFound if not registered
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(
                self._run(), name=f"kvstore-publisher-{self.node.node_id}"
            )

    async def stop(self, *, flush: bool = True, timeout: float = 5.0) -> None:
        """Stop the task; with ``flush``, publish what is still queued (best effort)."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if flush and self.error is None:
            with contextlib.suppress(KVStoreError, asyncio.TimeoutError):
                await asyncio.wait_for(self._publish_all(), timeout)

    async def _publish_all(self) -> None:
        while await self.run_once():
            pass
        await self.directory.flush(self.node.node_id)

    async def run_once(self) -> int:
        """Publish one batch (or re-sync after drops); returns how many events it took."""
        node_id = self.node.node_id
        dropped = self.node.events.dropped
        if dropped != self._seen_dropped:
            self._seen_dropped = dropped
            stale = len(self.node.take_events())  # the re-list supersedes them
            await self.resync()
            return max(stale, 1)
        events = self.node.take_events(self.batch)
        if events:
            self.revision = await self.directory.publish(node_id, events)
        elif self.directory.pending(node_id):
            self.revision = await self.directory.flush(node_id)
        return len(events)

    async def resync(self) -> int:
        """Re-list the node's blocks and make the directory match them."""
        snapshot: dict[bytes, tuple[TierKind, int | None]] = {
            bytes(key): (tier, size) for key, tier, size in self.node.snapshot()
        }
        self.resyncs += 1
        blocks: BlockSnapshot = snapshot
        self.revision = await self.directory.sync(self.node.node_id, blocks)
        log.info("re-synced %d blocks of node %s", len(snapshot), self.node.node_id)
        return self.revision

    async def _run(self) -> None:
        while not self._stopping:
            try:
                took = await self.run_once()
            except (ConflictError, NotFound) as exc:
                self.error = exc
                log.error("publisher for %s stopped: %s", self.node.node_id, exc)
                return
            except KVStoreError as exc:
                self.failures += 1
                log.debug("publish for %s failed, retrying: %s", self.node.node_id, exc)
                await asyncio.sleep(self.retry)
                continue
            if took == 0:
                await asyncio.sleep(self.interval)
